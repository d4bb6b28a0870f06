#!/usr/bin/env bash
# GPT-3 175B: 96 layers, d_model 12288, 96 heads, seq 2048, full activation recomputation.
# Layout (FP8-LM): TP8 PP4 with sequence parallelism, data parallel over the rest (default 4 nodes x 8 GPUs: DP 1; NNODES=64 gives DP 16). Every knob is an environment variable: see common.sh.
#   FP8_OPT_LEVEL=O2 NNODES=1 examples/gpt3/pretrain_gpt3_175B.sh          # torchrun on this node
#   DRY_RUN=1 examples/gpt3/pretrain_gpt3_175B.sh                          # plan, no GPU
set -euo pipefail
MODEL_NAME="GPT-3 175B"
: "${NUM_LAYERS:=96}"
: "${HIDDEN_SIZE:=12288}"
: "${NUM_ATTENTION_HEADS:=96}"
: "${TP:=8}"
: "${PP:=4}"
: "${NNODES:=4}"
: "${RECOMPUTE:=1}"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=1536}"
: "${LR:=6e-5}"
: "${MIN_LR:=6e-6}"
: "${LR_WARMUP_ITERS:=119}"
: "${TRAIN_ITERS:=95367}"
# shellcheck source=examples/gpt3/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

#!/usr/bin/env bash
# GPT-3 13B: 40 layers, d_model 5120 (the GPT-3 paper lists 5140, not divisible by 40 heads; Megatron and FP8-LM use 5120), 40 heads, seq 2048.
# Layout (FP8-LM): TP2 PP1 with sequence parallelism, data parallel over the rest (default 1 node x 8 GPUs: DP 4). Every knob is an environment variable: see common.sh.
#   FP8_OPT_LEVEL=O2 NNODES=1 examples/gpt3/pretrain_gpt3_13B.sh          # torchrun on this node
#   DRY_RUN=1 examples/gpt3/pretrain_gpt3_13B.sh                          # plan, no GPU
set -euo pipefail
MODEL_NAME="GPT-3 13B"
: "${NUM_LAYERS:=40}"
: "${HIDDEN_SIZE:=5120}"
: "${NUM_ATTENTION_HEADS:=40}"
: "${TP:=2}"
: "${PP:=1}"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=1024}"
: "${LR:=1e-4}"
: "${MIN_LR:=1e-5}"
: "${LR_WARMUP_ITERS:=179}"
: "${TRAIN_ITERS:=143051}"
# shellcheck source=examples/gpt3/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

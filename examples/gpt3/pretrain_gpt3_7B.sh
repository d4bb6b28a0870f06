#!/usr/bin/env bash
# GPT-3 6.7B ("7B"): 32 layers, d_model 4096, 32 heads, seq 2048.
# Layout (FP8-LM): TP1 PP1, data parallel over the rest (default 1 node x 8 GPUs). Every knob is an environment variable: see common.sh.
#   FP8_OPT_LEVEL=O2 NNODES=1 examples/gpt3/pretrain_gpt3_7B.sh          # torchrun on this node
#   DRY_RUN=1 examples/gpt3/pretrain_gpt3_7B.sh                          # plan, no GPU
set -euo pipefail
MODEL_NAME="GPT-3 7B"
: "${NUM_LAYERS:=32}"
: "${HIDDEN_SIZE:=4096}"
: "${NUM_ATTENTION_HEADS:=32}"
: "${TP:=1}"
: "${PP:=1}"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=1024}"
: "${LR:=1.2e-4}"
: "${MIN_LR:=1.2e-5}"
: "${LR_WARMUP_ITERS:=179}"
: "${TRAIN_ITERS:=143051}"
# shellcheck source=examples/gpt3/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

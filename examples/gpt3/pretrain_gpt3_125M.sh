#!/usr/bin/env bash
# GPT-3 Small (125M): 12 layers, d_model 768, 12 heads, seq 2048; runs on one machine (any GPU count).
# Layout (FP8-LM): TP1 PP1, data parallel over all GPUs of the node. Every knob is an environment variable: see common.sh.
#   FP8_OPT_LEVEL=O2 NNODES=1 examples/gpt3/pretrain_gpt3_125M.sh          # torchrun on this node
#   DRY_RUN=1 examples/gpt3/pretrain_gpt3_125M.sh                          # plan, no GPU
# On a GPU no linear of this model runs in FP8 by default: every per-rank GEMM has min(in, out) = 768, below
# pretrain_gpt.py's --fp8-min-dim (2048 on CUDA; announced at start-up), so "O2" trains the linears in BF16.
# To run them in FP8 (to see FP8 at work; expect no speed-up at this size): EXTRA_ARGS="--fp8-min-dim 0".
set -euo pipefail
MODEL_NAME="GPT-3 125M"
: "${NUM_LAYERS:=12}"
: "${HIDDEN_SIZE:=768}"
: "${NUM_ATTENTION_HEADS:=12}"
: "${TP:=1}"
: "${PP:=1}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then  # every GPU of this machine (1 without any)
    GPUS_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)
    ((GPUS_PER_NODE > 0)) || GPUS_PER_NODE=1
fi
: "${MICRO_BATCH_SIZE:=8}"
: "${GLOBAL_BATCH_SIZE:=$((MICRO_BATCH_SIZE * GPUS_PER_NODE * ${NNODES:-1}))}"
: "${LR:=6e-4}"
: "${MIN_LR:=6e-5}"
: "${LR_WARMUP_ITERS:=715}"
: "${TRAIN_ITERS:=20000}"
# shellcheck source=examples/gpt3/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

#!/usr/bin/env bash
# Mixtral-8x7B-class mixture of experts: 32 layers, d_model 4096, 32 heads with 8 query groups (GQA), RMSNorm, RoPE,
# untied embeddings, no biases; every MLP 8 SwiGLU experts of FFN 14336, top-2 routing (load-balancing loss 0.02);
# seq 4096, vocabulary 32000 (46.7B parameters, 12.9B active per token).
# Layout: TP1 PP8, the experts spread over EP=8 data-parallel ranks (one expert per GPU; with TP1 an expert-parallel
# group is 8 adjacent ranks: one node), each rank's experts one grouped FP8 GEMM per projection (--moe-grouped-gemm,
# which needs TP1: experts unsplit), all-to-all token dispatch in FP8 (--moe-fp8-dispatch at FP8 levels); default
# 8 nodes x 8 GPUs: DP 8, expert-DP 1 (NNODES=16: DP 16, expert-DP 2). Why: examples/moe/README.md. Every knob is an
# environment variable: see examples/gpt3/common.sh, plus
#   EP NUM_EXPERTS MOE_TOPK MOE_FFN_HIDDEN_SIZE MOE_AUX_LOSS_COEFF   experts: 8 8 2 14336 0.02
#   MOE_DISPATCHER     alltoall|allgather (default alltoall)   MOE_FP8_DISPATCH  1/0 (default 1; off at level none)
#   MOE_GROUPED_GEMM   1/0 (default 1: --moe-grouped-gemm; needs TP=1; MOE_GROUPED_GEMM=0 TP=2 PP=4 is the
#                      sequential experts split over TP with sequence parallelism)
#   NUM_QUERY_GROUPS   8
#   FP8_OPT_LEVEL=O2 NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 examples/moe/pretrain_mixtral_8x7b.sh   # torchrun
#   DRY_RUN=1 MOCK_DATA=1 examples/moe/pretrain_mixtral_8x7b.sh                                     # plan, no GPU
set -euo pipefail
MODEL_NAME="Mixtral-8x7B-class MoE"
: "${NUM_LAYERS:=32}"
: "${HIDDEN_SIZE:=4096}"
: "${NUM_ATTENTION_HEADS:=32}"
: "${NUM_QUERY_GROUPS:=8}"
: "${FFN_HIDDEN_SIZE:=14336}"
: "${SEQ_LENGTH:=4096}"
: "${TP:=1}"
: "${PP:=8}"
: "${EP:=8}"
: "${NNODES:=8}"
: "${GPUS_PER_NODE:=8}"
: "${NUM_EXPERTS:=8}"
: "${MOE_TOPK:=2}"
: "${MOE_FFN_HIDDEN_SIZE:=14336}"
: "${MOE_AUX_LOSS_COEFF:=0.02}"
: "${MOE_DISPATCHER:=alltoall}"
: "${MOE_FP8_DISPATCH:=1}"
: "${MOE_GROUPED_GEMM:=1}"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=1024}"
: "${LR:=3e-4}"
: "${MIN_LR:=3e-5}"
: "${LR_WARMUP_ITERS:=2000}"
: "${TRAIN_ITERS:=250000}"
: "${FP8_OPT_LEVEL:=O2}"
# The vocabulary of mock data and of planning without a tokenizer (with DATA_PATH it comes from the tokenizer).
[[ -z "${DATA_PATH:-}" ]] && : "${VOCAB_SIZE:=32000}"

fail() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}
for var in EP NUM_EXPERTS MOE_TOPK MOE_FFN_HIDDEN_SIZE NUM_QUERY_GROUPS NNODES GPUS_PER_NODE TP PP; do
    [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || fail "$var=${!var} must be a positive integer"
done
case "$MOE_DISPATCHER" in
    alltoall | allgather) ;;
    *) fail "MOE_DISPATCHER=$MOE_DISPATCHER: use alltoall or allgather" ;;
esac
case "$MOE_GROUPED_GEMM" in
    1) ((TP == 1)) || fail "MOE_GROUPED_GEMM=1 (--moe-grouped-gemm) runs each expert unsplit, but TP=$TP splits the experts: use TP=1 (the default; spread the experts with EP), or MOE_GROUPED_GEMM=0 for the sequential experts" ;;
    0) ;;
    *) fail "MOE_GROUPED_GEMM=$MOE_GROUPED_GEMM: use 1 (--moe-grouped-gemm) or 0 (the sequential experts)" ;;
esac
GPUS=$((NNODES * GPUS_PER_NODE))
if ((GPUS % (TP * PP) == 0)); then # (common.sh refuses the other case, naming the fix)
    DP_PLANNED=$((GPUS / (TP * PP)))
    ((DP_PLANNED % EP == 0)) || fail "EP=$EP must divide the data-parallel size $DP_PLANNED (= $GPUS GPUs / (TP $TP x PP $PP)): the experts are spread over data-parallel ranks; set NNODES so that DP is a multiple of $EP, or lower EP"
fi
((NUM_EXPERTS % EP == 0)) || fail "EP=$EP must divide NUM_EXPERTS=$NUM_EXPERTS"

MODEL_ARGS=(
    --num-query-groups "$NUM_QUERY_GROUPS"
    --swiglu
    --normalization RMSNorm
    --position-embedding-type rope
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --num-experts "$NUM_EXPERTS"
    --moe-router-topk "$MOE_TOPK"
    --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
    --moe-aux-loss-coeff "$MOE_AUX_LOSS_COEFF"
    --expert-model-parallel-size "$EP"
    --moe-token-dispatcher-type "$MOE_DISPATCHER"
)
[[ "$MOE_GROUPED_GEMM" == 1 ]] && MODEL_ARGS+=(--moe-grouped-gemm)
# FP8 token dispatch needs an FP8 level and the all-to-all dispatcher (the BF16 baseline dispatches in BF16).
if [[ "$MOE_FP8_DISPATCH" == 1 && "$FP8_OPT_LEVEL" != none && "$FP8_OPT_LEVEL" != O0 && "$MOE_DISPATCHER" == alltoall ]]; then
    MODEL_ARGS+=(--moe-fp8-dispatch)
fi
# common.sh passes EXTRA_ARGS to pretrain_gpt.py and to the planner; the caller's own EXTRA_ARGS come last (and win).
EXTRA_ARGS="${MODEL_ARGS[*]}${EXTRA_ARGS:+ $EXTRA_ARGS}"
# shellcheck source=examples/gpt3/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../gpt3/common.sh"

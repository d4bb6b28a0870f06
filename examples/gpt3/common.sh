# shellcheck shell=bash
# Shared launcher of examples/gpt3/pretrain_gpt3_*.sh: those set the model's defaults, then source this.
# Every knob is an environment variable (defaults below; the model scripts set the model-specific ones):
#
#   FP8_OPT_LEVEL      none|O1|O2|O3 (none = BF16 mixed-precision baseline; O0 = none) default O2
#   NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE   torchrun rendezvous  1 0 127.0.0.1 6000 8
#   RDZV_ID            set: torchrun's c10d rendezvous (elastic) with this id instead of the static one
#   TP PP VPP          tensor / pipeline parallel size, layers per virtual pipeline chunk (empty: none)
#   SEQUENCE_PARALLEL  1/0 (default: 1 when TP > 1)     RECOMPUTE  1/0 full activation recomputation
#   SEQ_LENGTH MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS LR MIN_LR LR_WARMUP_ITERS LR_DECAY_STYLE
#   WEIGHT_DECAY CLIP_GRAD EVAL_INTERVAL EVAL_ITERS LOG_INTERVAL SAVE_INTERVAL SEED
#   DATA_PATH          training data: PREFIX_text_document from tools/preprocess_data.py (required, or MOCK_DATA=1)
#   TOKENIZER_MODEL    its sentencepiece model (default PREFIX.model next to the data); the vocabulary comes from it
#   MOCK_DATA=1        synthetic tokens instead of DATA_PATH, vocabulary VOCAB_SIZE (default 50257, GPT-2's)
#   CHECKPOINT_DIR     --save and --load (resumes from its latest checkpoint)   LOG_JSON   --log-json PATH
#   EXIT_SIGNAL_HANDLER 1/0 (default 1): on SIGTERM/SIGUSR1 finish the iteration, save, stop
#   EXIT_DURATION_IN_MINS  stop (after saving) after this many minutes
#   BF16               1/0 (default 1)               EXTRA_ARGS more pretrain_gpt.py flags (word-split)
#   DISTRIBUTED_OPTIMIZER=1  --use-distributed-optimizer (BF16 baseline with ZeRO-1; FP8 shards with O3)
#   PYTHON TORCHRUN    interpreter and launcher       default python, torchrun
#   DRY_RUN=1          python pretrain_gpt.py <the same args> --dry-run --data-parallel-size DP (no GPU needed)
#   PLAN_ONLY=1        python tools/memory_planner.py <the same args> --data-parallel-size DP (PLAN_JSON=1: --json)
# DP = NNODES x GPUS_PER_NODE / (TP x PP).

REPO_ROOT=${REPO_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}

: "${FP8_OPT_LEVEL:=O2}"
: "${NNODES:=1}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=127.0.0.1}"
: "${MASTER_PORT:=6000}"
: "${GPUS_PER_NODE:=8}"
: "${TP:=1}"
: "${PP:=1}"
: "${VPP:=}"
: "${RECOMPUTE:=0}"
: "${SEQ_LENGTH:=2048}"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=1024}"
: "${TRAIN_ITERS:=100000}"
: "${LR:=1.2e-4}"
: "${MIN_LR:=1.2e-5}"
: "${LR_WARMUP_ITERS:=2000}"
: "${LR_DECAY_STYLE:=cosine}"
: "${WEIGHT_DECAY:=0.1}"
: "${CLIP_GRAD:=1.0}"
: "${EVAL_INTERVAL:=1000}"
: "${EVAL_ITERS:=10}"
: "${LOG_INTERVAL:=10}"
: "${SAVE_INTERVAL:=1000}"
: "${SEED:=1234}"
: "${BF16:=1}"
: "${PYTHON:=python}"
: "${TORCHRUN:=torchrun}"
: "${DRY_RUN:=0}"
: "${PLAN_ONLY:=0}"
: "${PLAN_JSON:=0}"
: "${MOCK_DATA:=0}"
: "${EXIT_SIGNAL_HANDLER:=1}"

fail() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}

case "$FP8_OPT_LEVEL" in
    none | O1 | O2 | O3) ;;
    O0) FP8_OPT_LEVEL=none ;; # the alias of the baseline, as in fp8.initialize and --fp8-opt-level
    *) fail "FP8_OPT_LEVEL=$FP8_OPT_LEVEL: use none, O1, O2 or O3 (O0 = none)" ;;
esac
for var in NNODES GPUS_PER_NODE TP PP MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE SEQ_LENGTH; do
    [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || fail "$var=${!var} must be a positive integer"
done
if [[ -z "${SEQUENCE_PARALLEL:-}" ]]; then
    if ((TP > 1)); then SEQUENCE_PARALLEL=1; else SEQUENCE_PARALLEL=0; fi
fi
WORLD_SIZE_PLANNED=$((NNODES * GPUS_PER_NODE))
if ((WORLD_SIZE_PLANNED % (TP * PP) != 0)); then
    fail "NNODES x GPUS_PER_NODE = $WORLD_SIZE_PLANNED GPUs is not a multiple of TP x PP = $((TP * PP)): set NNODES/GPUS_PER_NODE (or TP/PP) so it is"
fi
DP=$((WORLD_SIZE_PLANNED / (TP * PP)))

ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH_SIZE"
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style "$LR_DECAY_STYLE"
    --lr-warmup-iters "$LR_WARMUP_ITERS"
    --weight-decay "$WEIGHT_DECAY"
    --clip-grad "$CLIP_GRAD"
    --train-iters "$TRAIN_ITERS"
    --eval-interval "$EVAL_INTERVAL"
    --eval-iters "$EVAL_ITERS"
    --log-interval "$LOG_INTERVAL"
    --save-interval "$SAVE_INTERVAL"
    --seed "$SEED"
    --fp8-opt-level "$FP8_OPT_LEVEL"
)
[[ -n "${FFN_HIDDEN_SIZE:-}" ]] && ARGS+=(--ffn-hidden-size "$FFN_HIDDEN_SIZE")
[[ -n "$VPP" ]] && ARGS+=(--num-layers-per-virtual-pipeline-stage "$VPP")
[[ "$SEQUENCE_PARALLEL" == 1 ]] && ARGS+=(--sequence-parallel)
[[ "$RECOMPUTE" == 1 ]] && ARGS+=(--recompute-activations)
[[ "$BF16" == 1 ]] && ARGS+=(--bf16)
[[ "${DISTRIBUTED_OPTIMIZER:-0}" == 1 ]] && ARGS+=(--use-distributed-optimizer)
# Data: real data needs DATA_PATH (its vocabulary comes from the tokenizer); nothing is downloaded here.
if [[ -n "${DATA_PATH:-}" ]]; then
    [[ "$MOCK_DATA" == 1 ]] && fail "DATA_PATH and MOCK_DATA=1 exclude each other: unset one of them"
    [[ -n "${VOCAB_SIZE:-}" ]] && fail "VOCAB_SIZE=$VOCAB_SIZE applies to MOCK_DATA=1 only: with DATA_PATH the vocabulary comes from the tokenizer (TOKENIZER_MODEL); unset VOCAB_SIZE"
    case "$DATA_PATH" in
        *.bin | *.idx) fail "DATA_PATH=$DATA_PATH: give the prefix without .bin/.idx (PREFIX_text_document)" ;;
    esac
    if [[ -z "${TOKENIZER_MODEL:-}" ]]; then
        TOKENIZER_MODEL="${DATA_PATH%_text_document}.model"
        [[ -f "$TOKENIZER_MODEL" ]] || fail "TOKENIZER_MODEL is not set and $TOKENIZER_MODEL (next to DATA_PATH) does not exist: set TOKENIZER_MODEL to the sentencepiece model tools/preprocess_data.py wrote with the data"
    fi
    ARGS+=(--data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL")
elif [[ "$MOCK_DATA" == 1 ]]; then
    ARGS+=(--mock-data --vocab-size "${VOCAB_SIZE:-50257}")
elif [[ "$DRY_RUN" == 1 || "$PLAN_ONLY" == 1 ]]; then
    # Planning reads no data: the vocabulary of TOKENIZER_MODEL, else VOCAB_SIZE (default GPT-2's 50257).
    if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
        ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
    else
        ARGS+=(--vocab-size "${VOCAB_SIZE:-50257}")
    fi
else
    fail "DATA_PATH is not set: set DATA_PATH=PREFIX_text_document (written by tools/preprocess_data.py --output-prefix PREFIX; TOKENIZER_MODEL defaults to PREFIX.model), or MOCK_DATA=1 to train on synthetic tokens"
fi
[[ -n "${CHECKPOINT_DIR:-}" ]] && ARGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR")
RUN_ARGS=()  # training only (not for the planner)
[[ "$EXIT_SIGNAL_HANDLER" == 1 ]] && RUN_ARGS+=(--exit-signal-handler)
[[ -n "${EXIT_DURATION_IN_MINS:-}" ]] && RUN_ARGS+=(--exit-duration-in-mins "$EXIT_DURATION_IN_MINS")
[[ -n "${LOG_JSON:-}" ]] && ARGS+=(--log-json "$LOG_JSON")
if [[ -n "${EXTRA_ARGS:-}" ]]; then
    read -r -a EXTRA <<<"$EXTRA_ARGS"
    ARGS+=("${EXTRA[@]}")
fi

cd "$REPO_ROOT" || exit
echo "fp8lm $MODEL_NAME: FP8_OPT_LEVEL=$FP8_OPT_LEVEL TP=$TP PP=$PP DP=$DP (NNODES=$NNODES x GPUS_PER_NODE=$GPUS_PER_NODE)" >&2
if [[ "$DRY_RUN" == 1 ]]; then
    exec "$PYTHON" pretrain_gpt.py "${ARGS[@]}" --dry-run --data-parallel-size "$DP"
fi
if [[ "$PLAN_ONLY" == 1 ]]; then
    PLAN_FLAGS=()
    [[ "$PLAN_JSON" == 1 ]] && PLAN_FLAGS+=(--json)
    # pretrain_gpt.py --bf16 at level none keeps FP32 main gradients (Megatron's --bf16): plan them.
    [[ "$BF16" == 1 && "$FP8_OPT_LEVEL" == none ]] && PLAN_FLAGS+=(--accumulate-allreduce-grads-in-fp32)
    exec "$PYTHON" tools/memory_planner.py "${ARGS[@]}" --data-parallel-size "$DP" "${PLAN_FLAGS[@]}"
fi
if [[ -n "${RDZV_ID:-}" ]]; then
    RDZV=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID")
else
    RDZV=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
# SIGUSR1 (Slurm's warning before the time limit, sent to every process of the step) reaches the workers,
# whose --exit-signal-handler saves and stops; torchrun itself ignores it (an ignored signal stays ignored
# across exec; the workers install their own handler).
trap '' USR1
exec "$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" "${RDZV[@]}" pretrain_gpt.py "${ARGS[@]}" "${RUN_ARGS[@]}"

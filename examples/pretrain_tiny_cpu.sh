#!/usr/bin/env bash
# Tiny MLLM (ViT 2x64 + projector + GPT 4x64) fine-tuned on 2 CPU ranks over gloo, Optimus
# schedule, bf16 with the distributed optimizer, on LLaVA-format conversations about
# handwritten digits (0-4 images a sample: what digit, which of two is larger, how many in a
# strip, text-only sums) streamed through megatron-energon; validation with the answers' exact
# match. The data set and its tokenizer are made here, offline, if missing.
# Every setting can be overridden from the environment, Megatron-script style.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
NPROC=${NPROC:-2}
TP=${TP:-1}
PP=${PP:-2}
SCHEDULE=${SCHEDULE:-optimus}
TRAIN_ITERS=${TRAIN_ITERS:-600}
SAVE=${SAVE-out/demo_ckpt}                  # SAVE= (empty): no checkpoints
TRACE=${TRACE-out/demo_trace.json}          # TRACE= (empty): no trace
RAW=${RAW:-out/data/llava_digits}            # LLaVA JSON + images + tokenizer, made if missing
DATA_PATH=${DATA_PATH:-out/data/llava_digits_energon}  # energon dataset, converted if missing
RECORDS=${RECORDS:-2000}
PRECISION=${PRECISION:-bf16}  # bf16 (distributed optimizer's fp32 main params) or fp32
NUM_WORKERS=${NUM_WORKERS:-1}
read -r -a EXTRA_ARGS <<< "${EXTRA_ARGS:-}"  # more pretrain_mllm.py arguments, as one string

if [[ ! -f "$RAW/llava.json" ]]; then
    "$PYTHON" tools/make_llava_digits.py "$RAW" --records "$RECORDS"
fi
if [[ ! -f "$DATA_PATH/.nv-meta/dataset.yaml" ]]; then
    "$PYTHON" tools/llava_to_energon.py --json "$RAW/llava.json" --image-folder "$RAW/images" \
        --output-dir "$DATA_PATH" --val-fraction 0.05 --shard-size 500
fi

DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29533}")
MODEL_ARGS=(
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --encoder-num-layers 2 --encoder-hidden-size 64 --encoder-num-attention-heads 4
    --img-h 32 --patch-dim 8
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --bubble-schedule "$SCHEDULE"
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$RAW/tokenizer" --num-workers "$NUM_WORKERS"
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS"
    --lr "${LR:-1e-3}" --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0
    --seed 1234
)
PRECISION_ARGS=()
if [[ "$PRECISION" == bf16 ]]; then
    PRECISION_ARGS=(--bf16 --use-distributed-optimizer --overlap-grad-reduce
                    --accumulate-allreduce-grads-in-fp32)
fi
EVAL_ARGS=(--eval-interval 200 --eval-iters 6)
OUTPUT_ARGS=(--log-interval 50)
if [[ -n "$SAVE" ]]; then OUTPUT_ARGS+=(--save "$SAVE" --save-interval 200); fi
if [[ -n "$TRACE" ]]; then OUTPUT_ARGS+=(--trace "$TRACE"); fi

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_mllm.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${PRECISION_ARGS[@]}" "${EVAL_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${EXTRA_ARGS[@]}"

#!/usr/bin/env bash
# A tiny Qwen2-VL-shaped model (the native-resolution tower 2x64 + its 2x2 merger + a Qwen2
# backbone 4x64 with multimodal rotary positions and Q/K/V biases) fine-tuned on 2 CPU ranks
# over gloo, Optimus schedule, bf16 with the distributed optimizer, on the LLaVA-format digits
# conversations, each image at its own size, several conversations packed into each row.
# The data set and its tokenizer are made here, offline, if missing (as examples/
# pretrain_tiny_cpu.sh makes them). Every setting can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
NPROC=${NPROC:-2}
PP=${PP:-2}
SCHEDULE=${SCHEDULE:-optimus}
TRAIN_ITERS=${TRAIN_ITERS:-100}
SEQ=${SEQ:-128}                      # a packed row: several conversations
PACKING=${PACKING:-32}               # --packing-buffer-size; PACKING= (empty): one a row
SAVE=${SAVE-}                        # e.g. SAVE=out/qwen_vl_ckpt
RAW=${RAW:-out/data/llava_digits}
DATA_PATH=${DATA_PATH:-out/data/llava_digits_energon}
read -r -a EXTRA_ARGS <<< "${EXTRA_ARGS:-}"

if [[ ! -f "$RAW/llava.json" ]]; then
    "$PYTHON" tools/make_llava_digits.py "$RAW" --records 2000
fi
if [[ ! -f "$DATA_PATH/.nv-meta/dataset.yaml" ]]; then
    "$PYTHON" tools/llava_to_energon.py --json "$RAW/llava.json" --image-folder "$RAW/images" \
        --output-dir "$DATA_PATH" --val-fraction 0.05 --shard-size 500
fi

MODEL_ARGS=(
    --encoder-arch qwen2vl --patch-dim 4 --img-h 16 --spatial-merge-size 2
    --encoder-num-layers 2 --encoder-hidden-size 64 --encoder-num-attention-heads 4
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length "$SEQ"
    --normalization RMSNorm --swiglu --disable-bias-linear --add-qkv-bias
    --group-query-attention --num-query-groups 2 --mrope-section 2 3 3
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$RAW/tokenizer" --num-workers 1
    --min-pixels 64 --max-pixels 2304 --calculate-per-token-loss   # 8x8 to 48x48 pixels
)
if [[ -n "$PACKING" ]]; then DATA_ARGS+=(--packing-buffer-size "$PACKING"); fi
TRAINING_ARGS=(
    --pipeline-model-parallel-size "$PP" --bubble-schedule "$SCHEDULE"
    --micro-batch-size 2 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
    --lr "${LR:-1e-3}" --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters "${WARMUP:-10}"
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --accumulate-allreduce-grads-in-fp32
    --log-interval "${LOG_INTERVAL:-10}"
)
if [[ -n "$SAVE" ]]; then TRAINING_ARGS+=(--save "$SAVE" --save-interval 50); fi

"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" \
    --master-port "${MASTER_PORT:-29534}" pretrain_mllm.py \
    "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${EXTRA_ARGS[@]}"

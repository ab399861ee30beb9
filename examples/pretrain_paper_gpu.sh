#!/usr/bin/env bash
# The paper's MLLMs on H100 nodes (DESIGN section 5): ViT encoder + projector + GPT/Llama
# backbone, Optimus schedule, trained as Megatron recipes train: bf16 with the distributed
# optimizer, overlapped gradient reduce-scatter and parameter all-gather, fp32 gradient
# reduction, selective recomputation of the backbone (RECOMPUTE=full: full, uniform, 1 layer). Megatron-script style: every setting is an
# environment variable with a default; launch this on every node with NODE_RANK set.
#
#   MODEL=vit22b-gpt175b NNODES=384 NODE_RANK=0 MASTER_ADDR=host0 examples/pretrain_paper_gpu.sh
#   DRY_RUN=1 MODEL=vit11b-llama70b examples/pretrain_paper_gpu.sh   # check the job, start nothing
#
# Needs GPUs with NCCL; on CPU only DRY_RUN=1 is useful.
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1  # what megatron-core's overlapped communication assumes
cd "$(dirname "$0")/.."

MODEL=${MODEL:-vit22b-gpt175b}
PYTHON=${PYTHON:-python}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
DATA_PATH=${DATA_PATH:-}          # energon LLaVA dataset (tools/llava_to_energon.py); synthetic if empty
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}  # with DATA_PATH: the LLaVA's Hugging Face tokenizer directory
SAVE=${SAVE:-checkpoints/$MODEL}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-tensorboard/$MODEL}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1536}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-2}
TRAIN_ITERS=${TRAIN_ITERS:-10000}
SCHEDULE=${SCHEDULE:-optimus}
RECOMPUTE=${RECOMPUTE:-selective}   # selective | full | none

# ViTs: 48 layers, head dim 128; 448 px images in 14 px patches = 1024 image tokens, plus 1024
# text tokens = the backbone's 2048.
case "${MODEL%%-*}" in
    vit3b)  ENCODER_ARGS=(--encoder-hidden-size 2304 --encoder-ffn-hidden-size 9216 --encoder-num-attention-heads 18) ;;
    vit5b)  ENCODER_ARGS=(--encoder-hidden-size 3072 --encoder-ffn-hidden-size 12288 --encoder-num-attention-heads 24) ;;
    vit11b) ENCODER_ARGS=(--encoder-hidden-size 4096 --encoder-ffn-hidden-size 16384 --encoder-num-attention-heads 32) ;;
    vit22b) ENCODER_ARGS=(--encoder-hidden-size 6144 --encoder-ffn-hidden-size 24576 --encoder-num-attention-heads 48) ;;
    *) echo "error: MODEL=$MODEL: encoder '${MODEL%%-*}' is not one of vit3b vit5b vit11b vit22b" >&2; exit 2 ;;
esac
ENCODER_ARGS+=(--encoder-num-layers 48 --img-h 448 --patch-dim 14)

case "${MODEL#*-}" in
    gpt11b)
        BACKBONE_ARGS=(--num-layers 80 --hidden-size 3072 --num-attention-heads 24 --vocab-size 51200)
        TP=${TP:-4}; PP=${PP:-4}; NNODES=${NNODES:-32} ;;
    llama70b)
        BACKBONE_ARGS=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --vocab-size 32000
                       --ffn-hidden-size 28672 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
                       --disable-bias-linear --group-query-attention --num-query-groups 8)
        TP=${TP:-8}; PP=${PP:-4}; NNODES=${NNODES:-128} ;;
    gpt175b)
        BACKBONE_ARGS=(--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --vocab-size 51200)
        TP=${TP:-8}; PP=${PP:-8}; NNODES=${NNODES:-384} ;;
    *) echo "error: MODEL=$MODEL: backbone '${MODEL#*-}' is not one of gpt11b llama70b gpt175b" >&2; exit 2 ;;
esac
BACKBONE_ARGS+=(--seq-length 1024)

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel
    --bubble-schedule "$SCHEDULE"
)
DATA_ARGS=()
if [[ -n "$DATA_PATH" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "$TOKENIZER_MODEL" --num-workers 4
               --eval-interval 1000 --eval-iters 10)
fi
PRECISION_ARGS=(
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --accumulate-allreduce-grads-in-fp32
)
case "$RECOMPUTE" in
    selective) RECOMPUTE_ARGS=(--recompute-granularity selective) ;;
    full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
    none) RECOMPUTE_ARGS=() ;;
    *) echo "error: RECOMPUTE=$RECOMPUTE is not one of selective full none" >&2; exit 2 ;;
esac
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine
    --lr-warmup-iters 200 --weight-decay 0.1 --clip-grad 1.0 --seed 1234
    --distributed-timeout-minutes 30
)
OUTPUT_ARGS=(
    --log-interval 1 --save "$SAVE" --save-interval 500 --tensorboard-dir "$TENSORBOARD_DIR"
)
ARGS=("${ENCODER_ARGS[@]}" "${BACKBONE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${TRAINING_ARGS[@]}" "${PRECISION_ARGS[@]}" "${RECOMPUTE_ARGS[@]}" "${OUTPUT_ARGS[@]}")

if [[ -n "${DRY_RUN:-}" ]]; then
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) exec "$PYTHON" pretrain_mllm.py "${ARGS[@]}" --dry-run
fi
exec "$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_mllm.py "${ARGS[@]}"

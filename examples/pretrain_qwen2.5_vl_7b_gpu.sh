#!/usr/bin/env bash
# A Qwen2.5-VL-7B-shaped job on H100 nodes: the native-resolution tower (32 layers, hidden 1280,
# 16 heads, window attention over 112 px with full attention in layers 7, 15, 23 and 31, RMSNorm,
# gated SiLU MLP, the 2x2 merger) and a Qwen2.5-7B backbone (28 layers, hidden 3584, 28 heads in
# 4 KV groups, QKV bias, multimodal RoPE sections 16 24 24 at base 1e6), fine-tuned on packed
# LLaVA-format conversations with the Optimus schedule, bf16 with the distributed optimizer and
# overlapped reduction, as Megatron recipes train. Every setting is an environment variable
# with a default; launch this on every node with NODE_RANK set.
#
#   python tools/convert_hf.py hf-to-mcore --load-dir Qwen2.5-VL-7B-Instruct/ --save-dir ckpt/qwen25vl7b \
#       --seq-length 4096 --img-h 448
#   LOAD=ckpt/qwen25vl7b DATA_PATH=data/energon TOKENIZER_MODEL=Qwen2.5-VL-7B-Instruct/ \
#       NNODES=4 NODE_RANK=0 MASTER_ADDR=host0 examples/pretrain_qwen2.5_vl_7b_gpu.sh
#   DRY_RUN=1 examples/pretrain_qwen2.5_vl_7b_gpu.sh     # check the job, start nothing
#
# Plans: the backbone at TP 2 (sequence parallel) x PP 2, so each node holds two model replicas
# and the pipeline has bubbles for Optimus to fill; the tower's own plan is the planner's. Not
# yet on this job: Transformer Engine (the native tower and packing run megatron-core's local
# layers), per-step plans (the static plan costs the data set's mean patch load). Needs GPUs
# with NCCL; on CPU only DRY_RUN=1 is useful.
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1  # what megatron-core's overlapped communication assumes
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-2}
LOAD=${LOAD:-}                    # a converted Hugging Face checkpoint (tools/convert_hf.py)
DATA_PATH=${DATA_PATH:-}          # energon LLaVA dataset (tools/llava_to_energon.py); synthetic if empty
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}  # with DATA_PATH: Qwen2.5-VL's tokenizer directory
SAVE=${SAVE:-checkpoints/qwen2.5-vl-7b}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
TRAIN_ITERS=${TRAIN_ITERS:-2000}
SCHEDULE=${SCHEDULE:-optimus}

ENCODER_ARGS=(
    --encoder-arch qwen2.5vl --encoder-num-layers 32 --encoder-hidden-size 1280
    --encoder-num-attention-heads 16 --encoder-ffn-hidden-size 3420 --patch-dim 14 --img-h 448
    --spatial-merge-size 2 --temporal-patch-size 2 --encoder-window-size 112
    --encoder-full-attention-layers 7 15 23 31
)
BACKBONE_ARGS=(
    --num-layers 28 --hidden-size 3584 --num-attention-heads 28 --ffn-hidden-size 18944
    --group-query-attention --num-query-groups 4 --vocab-size 152064 --seq-length "$SEQ_LENGTH"
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --add-qkv-bias
    --mrope-section 16 24 24 --rotary-base 1000000
)
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
               --tokenizer-model "$TOKENIZER_MODEL" --image-token '<|image_pad|>' --num-workers 4
               --min-pixels 3136 --max-pixels 1003520 --packing-buffer-size 64
               --calculate-per-token-loss --eval-interval 500 --eval-iters 10)
fi
LOAD_ARGS=()
if [[ -n "$LOAD" ]]; then LOAD_ARGS=(--load "$LOAD" --use-checkpoint-args); fi
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine
    --lr-warmup-iters 50 --weight-decay 0.1 --clip-grad 1.0 --seed 1234
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --accumulate-allreduce-grads-in-fp32 --recompute-granularity selective
    --distributed-timeout-minutes 30
    --log-interval 1 --save "$SAVE" --save-interval 500
)
ARGS=("${ENCODER_ARGS[@]}" "${BACKBONE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${LOAD_ARGS[@]}" "${TRAINING_ARGS[@]}")

if [[ -n "${DRY_RUN:-}" ]]; then
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) exec "$PYTHON" pretrain_mllm.py "${ARGS[@]}" --dry-run
fi
exec "$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_mllm.py "${ARGS[@]}"

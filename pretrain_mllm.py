"""Pretrain a multimodal LLM (ViT encoder + projector + GPT backbone) on megatron-core.

    torchrun --nproc-per-node 2 pretrain_mllm.py --pipeline-model-parallel-size 2 \
        --micro-batch-size 1 --global-batch-size 8 --train-iters 20 --bubble-schedule optimus

Megatron argument names (see --help); the encoder gets its own plan and its work goes into the
backbone's pipeline bubbles (--bubble-schedule optimus).
"""

import sys

from megatron_mllm.training.train import main

if __name__ == "__main__":  # dist_checkpointing's helper processes re-import this file
    sys.exit(main())

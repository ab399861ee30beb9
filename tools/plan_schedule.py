#!/usr/bin/env python
"""Plan megatron / balanced / optimus schedules for a multimodal LLM job and compare them.

    python tools/plan_schedule.py --encoder vit-22b --backbone gpt-175b --gpus 3072 --tp 8 \
        --pp 8 --global-batch 1536 --micro-batch 2 --seq-len 2048 --gpu h100 --json
"""

import sys

from megatron_mllm.cli.plan_schedule import main

if __name__ == "__main__":
    sys.exit(main())

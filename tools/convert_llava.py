#!/usr/bin/env python
"""Convert Hugging Face LLaVA checkpoints to megatron_mllm torch_dist checkpoints and back
(tools/convert_hf.py under its older name; it converts Qwen2-VL too).

    python tools/convert_llava.py hf-to-mcore --load-dir HF_DIR --save-dir CKPT [--seq-length 64]
    torchrun ... pretrain_mllm.py --load CKPT --use-checkpoint-args ...   # any pair of plans
    python tools/convert_llava.py mcore-to-hf --load-dir CKPT --save-dir HF_OUT

Mapped: LlavaForConditionalGeneration with a CLIP vision tower and a Llama language model.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from convert_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))

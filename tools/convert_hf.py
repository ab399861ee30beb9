#!/usr/bin/env python
"""Convert Hugging Face checkpoints to megatron_mllm torch_dist checkpoints and back; the
architecture is read from config.json.

    python tools/convert_hf.py hf-to-mcore --load-dir HF_DIR --save-dir CKPT [--seq-length 64]
        [--img-h N]
    torchrun ... pretrain_mllm.py --load CKPT --use-checkpoint-args ...   # any pair of plans
    python tools/convert_hf.py mcore-to-hf --load-dir CKPT --save-dir HF_OUT

Mapped: LlavaForConditionalGeneration (a CLIP vision tower and a Llama language model),
Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration (the native-resolution
tower, Qwen2.5-VL's with window attention; a Qwen2 language model with multimodal rotary
positions). Fields we do not map are refused in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mllm.errors import OneLineParser, exit_on_config_error  # noqa: E402


@exit_on_config_error
def main(argv: list[str] | None = None, doc: str = __doc__) -> int:
    p = OneLineParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--seq-length", type=int, default=64, help="hf-to-mcore: text tokens per sample")
    p.add_argument(
        "--img-h",
        type=int,
        default=None,
        help="hf-to-mcore, Qwen2-VL and Qwen2.5-VL: the nominal image the planner costs "
        "(default 8 merged windows a side)",
    )
    p.add_argument(
        "--image-token-index",
        type=int,
        default=None,
        help="mcore-to-hf: default the source model's, else the last vocabulary id",
    )
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its notes on token ids of tiny vocabularies
    from megatron_mllm.training.convert_hf import hf_to_mcore, mcore_to_hf

    if args.direction == "hf-to-mcore":
        cfg = hf_to_mcore(args.load_dir, args.save_dir, args.seq_length, args.img_h)
        qwen = "Qwen2.5-VL" if cfg.vit_swiglu else "Qwen2-VL"
        tower = f"{qwen} native-resolution" if cfg.vit_native else "CLIP"
        backbone = "Qwen2" if cfg.llm_qkv_bias else "Llama"
        print(
            f"wrote {args.save_dir}/iter_0000000 (model only): {tower} {cfg.vit_layers}x"
            f"{cfg.vit_hidden} + {backbone} {cfg.llm_layers}x{cfg.llm_hidden}; train it with "
            f"pretrain_mllm.py --load {args.save_dir} --use-checkpoint-args"
        )
    else:
        config = mcore_to_hf(args.load_dir, args.save_dir, args.image_token_index)
        print(f"wrote {args.save_dir} ({config.architectures[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

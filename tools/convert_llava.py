#!/usr/bin/env python
"""Convert Hugging Face LLaVA checkpoints to megatron_mllm torch_dist checkpoints and back.

    python tools/convert_llava.py hf-to-mcore --load-dir HF_DIR --save-dir CKPT [--seq-length 64]
    torchrun ... pretrain_mllm.py --load CKPT --use-checkpoint-args ...   # any pair of plans
    python tools/convert_llava.py mcore-to-hf --load-dir CKPT --save-dir HF_OUT

Mapped: LlavaForConditionalGeneration with a CLIP vision tower and a Llama language model.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mllm.errors import exit_on_config_error  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--seq-length", type=int, default=64, help="hf-to-mcore: text tokens per sample")
    p.add_argument(
        "--image-token-index",
        type=int,
        default=None,
        help="mcore-to-hf: default the source LLaVA's, else the last vocabulary id",
    )
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron_mllm.training.convert_llava import hf_to_mcore, mcore_to_hf

    if args.direction == "hf-to-mcore":
        cfg = hf_to_mcore(args.load_dir, args.save_dir, args.seq_length)
        print(
            f"wrote {args.save_dir}/iter_0000000 (model only): CLIP {cfg.vit_layers}x"
            f"{cfg.vit_hidden} + Llama {cfg.llm_layers}x{cfg.llm_hidden}; train it with "
            f"pretrain_mllm.py --load {args.save_dir} --use-checkpoint-args"
        )
    else:
        mcore_to_hf(args.load_dir, args.save_dir, args.image_token_index)
        print(f"wrote {args.save_dir} (LlavaForConditionalGeneration)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

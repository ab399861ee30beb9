#!/usr/bin/env python
"""Convert megatron-core LLaVAModel torch_dist checkpoints (Megatron-LM's multimodal example:
language_model.*, vision_model.*, vision_projection.*) to megatron_mllm checkpoints and back.

    python tools/convert_mcore_llava.py import --load-dir MCORE_CKPT --save-dir CKPT \\
        --encoder-arch clip --num-layers 32 --hidden-size 4096 ...   # pretrain_mllm's model flags
    torchrun ... pretrain_mllm.py --load CKPT --use-checkpoint-args ...   # any pair of plans
    python tools/convert_mcore_llava.py export --load-dir CKPT --save-dir MCORE_OUT

Import reads the model tensors only (optimizer state is left behind) and never unpickles the
checkpoint's common state, where Megatron-LM keeps its arguments: give the model flags the
checkpoint was trained with, in pretrain_mllm.py's (Megatron's) names; every tensor's shape is
checked against them. Export writes <save-dir>/release as megatron-core's LLaVAModel saves its
model (local layer specs' names); load it in Megatron-LM with --finetune. Mapped: a CLIP tower
(--encoder-arch clip), the MLP projector and a GPT language model with RoPE.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mllm.errors import OneLineParser, exit_on_config_error  # noqa: E402


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("direction", choices=["import", "export"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    args, model_flags = p.parse_known_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron_mllm.training import convert_mcore_llava as convert

    if args.direction == "export":
        if model_flags:
            p.error(f"export reads the model from the checkpoint; drop {' '.join(model_flags)}")
        cfg = convert.export_llava(args.load_dir, args.save_dir)
        print(
            f"wrote {args.save_dir}/release (megatron-core LLaVAModel, model only): CLIP "
            f"{cfg.vit_layers}x{cfg.vit_hidden} + GPT {cfg.llm_layers}x{cfg.llm_hidden}"
        )
        return 0
    from megatron_mllm.training.arguments import build_parser
    from megatron_mllm.training.model_args import model_args, model_config

    cfg = model_config(build_parser().parse_args(model_flags))
    count = convert.import_llava(args.load_dir, args.save_dir, cfg, model_args(cfg))
    print(
        f"wrote {args.save_dir}/iter_0000000 (model only, {count} tensors): CLIP "
        f"{cfg.vit_layers}x{cfg.vit_hidden} + GPT {cfg.llm_layers}x{cfg.llm_hidden}; train it "
        f"with pretrain_mllm.py --load {args.save_dir} --use-checkpoint-args"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

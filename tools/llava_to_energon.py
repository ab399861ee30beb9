#!/usr/bin/env python
"""Convert a LLaVA-format JSON/JSONL file and its images into a megatron-energon dataset (tar
shards with splits "train" and "val", images kept as their original bytes) in a new folder.

    python tools/llava_to_energon.py --json FILE --image-folder DIR --output-dir OUT \\
        [--shard-size 1000] [--val-fraction 0.05] [--seed 0]

Every record and image is checked first; OUT appears only when the dataset is complete.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mllm.data.llava import DEFAULT_MAX_IMAGE_PIXELS  # noqa: E402
from megatron_mllm.errors import ConfigError, exit_on_config_error  # noqa: E402


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", required=True, help="LLaVA records: a JSON list or JSONL file")
    p.add_argument("--image-folder", required=True, help="the folder the image names are under")
    p.add_argument("--output-dir", required=True, help="a new (or empty) folder for the dataset")
    p.add_argument("--shard-size", type=int, default=1000, help="records per tar shard")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of records for val")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle before the split")
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="refuse an image with more pixels (default: Pillow's decompression-bomb bound)",
    )
    args = p.parse_args(argv)
    if args.max_image_pixels < 1:
        raise ConfigError(f"--max-image-pixels {args.max_image_pixels}: give a positive count")
    if args.shard_size < 1:
        raise ConfigError(f"--shard-size {args.shard_size}: give a whole number of records >= 1")
    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction {args.val_fraction}: give a fraction with 0 <= F < 1")

    from megatron_mllm.data.energon_llava import convert_llava

    counts = convert_llava(
        args.json,
        args.image_folder,
        args.output_dir,
        shard_size=args.shard_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        max_image_pixels=args.max_image_pixels,
    )
    print(
        f"wrote {counts['train']} train and {counts['val']} val records in {counts['shards']} "
        f"shards to {args.output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Write the tiny LLaVA-format data set (digits as PNG/JPEG of varying size; one-, two- and
no-image conversations) to a new folder: OUT/llava.json, OUT/images/ and OUT/tokenizer/ (a
byte-level BPE trained on the conversations, with an image token and a chat template).

    python tools/make_llava_digits.py out/data/llava_digits [--records 400] [--seed 0]
        [--images-per-sample 0:0.2,1:0.3,4:0.3,8:0.2] [--image-sizes 16:0.4,64:0.3,160:0.3]
        [--chat-template qwen]    # Qwen2-VL's ChatML and vision tokens: train with
                                  # --image-token '<|image_pad|>'
"""

import argparse
import sys

from megatron_mllm.data.llava_digits import conversation_texts, write_llava_digits
from megatron_mllm.data.tokenizer import train_tiny_tokenizer
from megatron_mllm.errors import exit_on_config_error


@exit_on_config_error
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=384, help="the tokenizer's vocabulary size")
    ap.add_argument(
        "--images-per-sample",
        default=None,
        metavar="DIST",
        help="draw each record's image count from DIST, e.g. 0:0.2,1:0.3,4:0.3,8:0.2 (the "
        "share of records with that many images); default: the four sources in turn (0-2)",
    )
    ap.add_argument(
        "--image-sizes",
        default=None,
        metavar="DIST",
        help="draw each image's side in pixels from DIST, e.g. 16:0.4,64:0.3,160:0.3 (the share "
        "of images of that size; for native-resolution towers); default: 16, 24, 32 or 48",
    )
    ap.add_argument(
        "--chat-template",
        choices=["plain", "qwen"],
        default="plain",
        help="the tokenizer's chat template: plain ('role: text</s>', image token <image>) or "
        "qwen (Qwen2-VL's ChatML, each image <|vision_start|> <|image_pad|>... <|vision_end|>)",
    )
    args = ap.parse_args()
    from megatron_mllm.schedule.loads import parse_distribution

    dist = parse_distribution(args.images_per_sample) if args.images_per_sample else None
    sizes = None
    if args.image_sizes:
        sizes = parse_distribution(args.image_sizes, "--image-sizes", "16:0.5,48:0.5")
    if sizes and min(sizes) < 8:
        raise SystemExit(f"error: --image-sizes {args.image_sizes}: sides of at least 8 pixels")
    path = write_llava_digits(args.out, args.records, args.seed, dist, sizes)
    texts = conversation_texts(path)
    tok = train_tiny_tokenizer(texts, path.parent / "tokenizer", args.vocab, args.chat_template)
    print(
        f"wrote {args.records} records to {path} (images in {path.parent / 'images'}), "
        f"tokenizer of {len(tok)} tokens in {path.parent / 'tokenizer'} (image token "
        f"{tok.image_token})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

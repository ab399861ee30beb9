#!/usr/bin/env python
"""Write the tiny LLaVA-format data set (digits as PNG/JPEG of varying size; one-, two- and
no-image conversations) to a new folder: OUT/llava.json and OUT/images/.

    python tools/make_llava_digits.py out/data/llava_digits [--records 400] [--seed 0]
"""

import argparse
import sys

from megatron_mllm.data.llava_digits import write_llava_digits
from megatron_mllm.errors import exit_on_config_error


@exit_on_config_error
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = write_llava_digits(args.out, args.records, args.seed)
    print(f"wrote {args.records} records to {path} (images in {path.parent / 'images'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

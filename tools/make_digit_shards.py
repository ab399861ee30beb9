#!/usr/bin/env python
"""Write the tiny default image-caption data set (scikit-learn's digits) as WebDataset shards.

python tools/make_digit_shards.py out/data/digits
"""

import sys

from megatron_mllm.data.webdataset import write_digit_shards

if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "out/data/digits"
    paths = write_digit_shards(target)
    print(f"wrote {len(paths)} shards to {target}")

#!/usr/bin/env python
"""What sequence packing buys on the LLaVA digits: useful (non-padding) tokens per row and the
padding share, with and without packing, at two sequence lengths (the loader alone); and the
training step's useful tokens per second padded at the demo's --seq-length 64 against packed
at 64 and at 128 (a longer row is where packing pays: the demo's samples average ~42 tokens, so
two rarely share a row of 64), on 2 CPU ranks (the demo's model, PP=2 Optimus, bf16 + the
distributed optimizer, per-token loss, 16 rows a step).

    python tools/bench_packing.py [--data out/data/llava_digits_energon]
        [--tokenizer out/data/llava_digits/tokenizer] [--seq 64 128] [--repeats 3] [--json]

Rows: --rows training rows read by one stream (buffers of --buffer samples). Training: the
runs alternate, --repeats times each, --iters iterations each (the first quarter of each run's
iterations is warm-up, not counted); figures are medians over the repeats (min-max shown).
Useful tokens per second: samples per second times the tokens a sample keeps at that length
(from the row measurement).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def row_fill(data: str, tokenizer: str, seq: int, buffer: int, rows: int) -> dict:
    """Samples and useful tokens per row of `seq` over `rows` rows packed from buffers of
    `buffer` samples (buffer 1: one sample a row, i.e. padding)."""
    from megatron_mllm.data.llava_source import LlavaData, LlavaStream

    spec = LlavaData(data, tokenizer, seq, num_workers=0, packing_buffer_size=buffer)
    stream = LlavaStream(spec, "train", 0, 1, 1, 16, 32, seed=0)
    try:
        got = stream.take(rows)
    finally:
        stream.close()
    samples = sum(len(b.ids) for b in got)
    useful = sum(int((b.segments >= 0).sum()) for b in got)
    return {
        "samples_per_row": samples / rows,
        "useful_tokens_per_row": useful / rows,
        "padding_share": 1 - useful / (rows * seq),
        "tokens_per_sample": useful / samples,
    }


def train_rate(
    data: str, tokenizer: str, iters: int, seq: int, packing: int | None, port: int
) -> float:
    """Samples per second the demo's training step takes in at `seq` (median over its
    iterations after the first quarter), with or without packing."""
    gbs = 16
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(port), str(ROOT / "pretrain_mllm.py"),
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(seq), "--encoder-num-layers", "2", "--encoder-hidden-size", "64",
        "--encoder-num-attention-heads", "4", "--img-h", "32", "--patch-dim", "8",
        "--pipeline-model-parallel-size", "2", "--bubble-schedule", "optimus",
        "--data-path", data, "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tokenizer, "--num-workers", "1", "--calculate-per-token-loss",
        "--micro-batch-size", "4", "--global-batch-size", str(gbs), "--train-iters", str(iters),
        "--lr", "3e-3", "--log-interval", "1", "--bf16", "--use-distributed-optimizer",
    ]  # fmt: skip
    if packing is not None:
        cmd += ["--packing-buffer-size", str(packing)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    ms = [float(m) for m in re.findall(r"per iteration \(ms\): ([0-9.]+)", out.stdout)]
    if packing is None:
        per_iter = [gbs] * len(ms)
    else:
        seen = [int(n) for n in re.findall(r"packed samples: (\d+) \|", out.stdout)]
        per_iter = [b - a for a, b in zip([0, *seen], seen, strict=False)]
    start = len(ms) // 4
    pairs = zip(per_iter[start:], ms[start:], strict=True)
    return statistics.median(1000 * n / t for n, t in pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "out/data/llava_digits_energon"))
    ap.add_argument("--tokenizer", default=str(ROOT / "out/data/llava_digits/tokenizer"))
    ap.add_argument("--seq", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--buffer", type=int, default=32, help="--packing-buffer-size")
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from bench_common import demo_data_or_exit

    demo_data_or_exit(args.data)
    fill = {
        seq: {
            "padded": row_fill(args.data, args.tokenizer, seq, 1, args.rows),
            "packed": row_fill(args.data, args.tokenizer, seq, args.buffer, args.rows),
        }
        for seq in sorted({*args.seq, 64, 128})  # the training runs use 64 and 128
    }
    configs = {"padded_64": (64, None), "packed_64": (64, args.buffer)}
    configs["packed_128"] = (128, args.buffer)
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.repeats):  # alternating, so the machine's drift hits every run alike
        for k, (name, (seq, buf)) in enumerate(configs.items()):
            port = 29601 + 10 * r + k
            rate = train_rate(args.data, args.tokenizer, args.iters, seq, buf, port)
            kind = "padded" if buf is None else "packed"
            runs[name].append(rate * fill[seq][kind]["tokens_per_sample"])
    base = runs["padded_64"]
    ratios = {
        name: [x / y for x, y in zip(v, base, strict=True)]
        for name, v in runs.items()
        if name != "padded_64"
    }
    out = {
        "rows": fill,
        "train_useful_tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
        "train_range": {k: (min(v), max(v)) for k, v in runs.items()},
        "vs_padded_64": {k: statistics.median(v) for k, v in ratios.items()},
        "vs_padded_64_range": {k: (min(v), max(v)) for k, v in ratios.items()},
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'seq':>5} {'rows':<8}{'samples/row':>12}{'useful tok/row':>16}{'padding':>9}")
    for seq, both in fill.items():
        for name, f in both.items():
            print(
                f"{seq:>5} {name:<8}{f['samples_per_row']:12.2f}"
                f"{f['useful_tokens_per_row']:16.1f}{f['padding_share']:9.1%}"
            )
    print("training, useful tokens per second (median of repeats, min-max; x padded at 64):")
    for name, v in runs.items():
        ratio = statistics.median(ratios[name]) if name in ratios else 1.0
        print(f"  {name:<11}{statistics.median(v):9.0f}  ({min(v):.0f}-{max(v):.0f})  {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

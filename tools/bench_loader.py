#!/usr/bin/env python
"""Is the data loader what a training step waits for? Samples per second of the energon LLaVA
loader alone (decode, tokenise, preprocess, batch) with 0, 1 and 2 worker processes, against
what the tiny demo's training step consumes (measured in the same run: pretrain_mllm.py on 2
CPU ranks, PP=2 Optimus, each rank reading its replica's stream).

    python tools/bench_loader.py [--data out/data/llava_digits_energon]
        [--tokenizer out/data/llava_digits/tokenizer] [--batches 40] [--repeats 3] [--json]

Each figure is the median of --repeats passes (min-max shown) of --batches micro-batches of
--micro-batch samples after one warm-up batch. The loader runs on its own here; in training it
shares the cores with the step, so these are its best case.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def loader_rate(data, tokenizer, workers: int, micro_batch: int, batches: int, seq: int) -> float:
    """Samples per second of one DP rank's stream (after a warm-up batch)."""
    from megatron_mllm.data.llava_source import LlavaData, LlavaStream

    spec = LlavaData(str(data), str(tokenizer), seq, num_workers=workers)
    stream = LlavaStream(spec, "train", 0, 1, micro_batch, 16, 32, seed=0)
    stream.next()
    start = time.perf_counter()
    for _ in range(batches):
        stream.next()
    seconds = time.perf_counter() - start
    stream.close()
    return batches * micro_batch / seconds


def step_consumption(data, tokenizer, iters: int, gbs: int) -> list[float]:
    """Samples per second each rank's loader must supply during the demo's training steps."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", "29591", str(ROOT / "pretrain_mllm.py"),
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--encoder-num-layers", "2", "--encoder-hidden-size", "64",
        "--encoder-num-attention-heads", "4", "--img-h", "32", "--patch-dim", "8",
        "--pipeline-model-parallel-size", "2", "--bubble-schedule", "optimus",
        "--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tokenizer), "--num-workers", "1",
        "--micro-batch-size", "4", "--global-batch-size", str(gbs), "--train-iters", str(iters),
        "--lr", "3e-3", "--log-interval", "1", "--bf16", "--use-distributed-optimizer",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    ms = [float(m) for m in re.findall(r"per iteration \(ms\): ([0-9.]+)", out.stdout)]
    return [1000 * gbs / t for t in ms[len(ms) // 4 :]]  # after the first quarter (warm-up)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / "out/data/llava_digits_energon"))
    ap.add_argument("--tokenizer", default=str(ROOT / "out/data/llava_digits/tokenizer"))
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from bench_common import demo_data_or_exit

    demo_data_or_exit(args.data)
    rates = {}
    for workers in (0, 1, 2):
        rates[workers] = [
            loader_rate(args.data, args.tokenizer, workers, args.micro_batch, args.batches, 64)
            for _ in range(args.repeats)
        ]
    step = step_consumption(args.data, args.tokenizer, args.iters, 16)
    need = statistics.median(step)
    out = {
        "loader_samples_per_s": {w: statistics.median(r) for w, r in rates.items()},
        "loader_range": {w: (min(r), max(r)) for w, r in rates.items()},
        "step_consumes_samples_per_s": need,
        "step_range": (min(step), max(step)),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'loader':<22}{'samples/s':>12}{'min-max':>20}{'x step':>10}")
    for w, r in rates.items():
        med = statistics.median(r)
        span = f"{min(r):.0f}-{max(r):.0f}"
        print(f"{f'{w} worker(s)':<22}{med:12.0f}{span:>20}{med / need:10.1f}")
    print(
        f"{'training step needs':<22}{need:12.0f}{f'{min(step):.0f}-{max(step):.0f}':>20}"
        f"{'1.0':>10}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

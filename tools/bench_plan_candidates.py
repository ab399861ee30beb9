#!/usr/bin/env python
"""Benchmark: the plan-candidate phase as a real job runs it.

`pretrain_mllm.py --plan-candidates K` on 2 ranks (torchrun, 1 thread each), bench_runtime's
model and settings (bf16, distributed optimizer, overlapped reduce and gather), one job per
repeat in fresh processes with nothing else in them. bench_runtime runs the same phase with
eight other runs stepping in turn in the same processes (so machine drift hits them alike); here
each step follows the job's own. From the table the job prints after its phase, per repeat:
each candidate's prediction made in the job after warm-up against its measurement, and the kept
plan against the Megatron schedule's candidate (both measured in the same job, in mirrored
windows). The start-up plan is pretrain_mllm.py's own (the analytic cost model).
`--layout-warmups 3,0`: per repeat one job for each --plan-candidate-layout-warmup, in turn
(the order alternating between repeats), side by side.

    python tools/bench_plan_candidates.py --size tiny|medium [--microbatches 4] --repeats 3 \\
        --encoder-wgrad-split --backbone-wgrad-split [--layout-warmups 3,0] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from megatron_mllm.training.plan_candidates import LAYOUT_WARMUP, STEPS_EACH, most_steps

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"(nan|[\d.]+)"  # a candidate whose costs could not be rebuilt has no prediction
ROW = re.compile(rf"^ {{3}}(\S.*?)\s+{NUMBER} ms\s+{NUMBER} ms\s*{NUMBER} ms\s*(yes)?\s*$")


def main() -> int:
    args = parse_args()
    repeats: dict[int, list] = {w: [] for w in args.layout_warmups}
    for r in range(args.repeats):
        order = args.layout_warmups if r % 2 == 0 else args.layout_warmups[::-1]
        for warmup in order:
            rows = run_job(args, warmup)
            repeats[warmup].append(rows)
            print(f"repeat {r + 1}/{args.repeats}, layout warm-up {warmup}:", flush=True)
            for row in rows:
                print(
                    f"   {row['label']:<50} predicted {1e3 * row['predicted_s']:8.1f} ms  "
                    f"measured {1e3 * row['measured_s']:8.1f} ms  error {error(row):+.3f}"
                    + ("  kept" if row["kept"] else ""),
                    flush=True,
                )
    result = {str(w): summarise(rows, args, w) for w, rows in repeats.items()}
    for w, out in result.items():
        for key in (
            "candidate_prediction_error",
            "candidate_relative_error",
            "kept_vs_megatron_candidate",
        ):
            v, lo, hi = out[key], out[key + "_min"], out[key + "_max"]
            print(f"layout warm-up {w}: {key} {v:.3f} ({lo:.3f}-{hi:.3f})")
    if args.json:  # last, after the lines above
        print(json.dumps(result, indent=1))
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="jobs, one after another")
    ap.add_argument("--plan-candidates", type=int, default=2)
    ap.add_argument(
        "--train-iters", type=int, default=None, help="default: the longest phase's length + 2"
    )
    ap.add_argument("--ddp-bucket-size", type=int, default=2_000_000)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--encoder-wgrad-split", action="store_true")
    ap.add_argument("--backbone-wgrad-split", action="store_true")
    ap.add_argument(
        "--layout-warmups",
        type=lambda text: list(dict.fromkeys(int(x) for x in text.split(","))),
        default=[LAYOUT_WARMUP],
        help="--plan-candidate-layout-warmup values, one job each per repeat (e.g. 3,0)",
    )
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def job_argv(args, layout_warmup: int) -> list[str]:
    """pretrain_mllm.py's arguments: bench_runtime's run, with the candidate phase."""
    from bench_common import bench_argv, bench_config

    from megatron_mllm.parallel.plans import ParallelPlan

    cfg = bench_config(args.size)
    argv = bench_argv(cfg, args, ParallelPlan(1, 1, 2), args.microbatches, args.micro_batch)
    argv += ["--bubble-schedule", "optimus", "--plan-candidates", str(args.plan_candidates)]
    iters = args.train_iters or 2 + most_steps(
        args.plan_candidates,
        args.encoder_wgrad_split + args.backbone_wgrad_split,
        STEPS_EACH,
        layout_warmup,
    )
    argv += ["--train-iters", str(iters), "--log-interval", str(iters)]
    argv += ["--encoder-wgrad-split"] * args.encoder_wgrad_split
    argv += ["--backbone-wgrad-split"] * args.backbone_wgrad_split
    return argv + ["--plan-candidate-layout-warmup", str(layout_warmup)]


def run_job(args, layout_warmup: int) -> list[dict]:
    """One job in fresh processes; its candidate table's rows."""
    with socket.socket() as s:  # a free port for the job's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += [
        "--master-port",
        str(port),
        str(ROOT / "pretrain_mllm.py"),
        *job_argv(args, layout_warmup),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=3600
    )
    if out.returncode != 0:
        lines = (out.stdout + out.stderr).strip().splitlines()
        said = [line for line in lines if line.lower().startswith("error")][:3] or lines[-5:]
        raise SystemExit("error: the job failed: " + "\n".join(said))
    rows = parse_table(out.stdout)
    if not rows:
        raise SystemExit(
            "error: the job printed no candidate table (phase longer than --train-iters?)"
        )
    return rows


def parse_table(text: str) -> list[dict]:
    """The rows of the candidate table pretrain_mllm.py prints after its phase."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            label, start, pred, meas, kept = m.groups()
            rows.append(
                {
                    "label": label,
                    "predicted_startup_s": float(start) / 1e3,
                    "predicted_s": float(pred) / 1e3,
                    "measured_s": float(meas) / 1e3,
                    "kept": kept is not None,
                }
            )
    return rows


def error(row: dict) -> float:
    """(predicted - measured) / measured."""
    return row["predicted_s"] / row["measured_s"] - 1


def relative_errors(rows: list[dict]) -> dict[str, float]:
    """Each later candidate's predicted / measured over the first's, less one: its error with
    what the job drifted between the warm-up and the timed windows (and the first candidate's
    own error) divided out; NaN where a prediction is missing."""
    first = rows[0]["predicted_s"] / rows[0]["measured_s"]
    return {r["label"]: r["predicted_s"] / r["measured_s"] / first - 1 for r in rows[1:]}


def _worst(errors) -> float:
    """The largest |error| among those with a prediction (NaN where none has one)."""
    known = [abs(e) for e in errors if not math.isnan(e)]
    return max(known, default=float("nan"))


def summarise(repeats: list[list[dict]], args, layout_warmup: int) -> dict:
    """Medians and min-max over repeats of the worst prediction error (as it is, and relative
    to the first candidate's) and of the kept plan's speed against the Megatron schedule's
    candidate; the Megatron candidate's relative error in each repeat."""
    from bench_common import over_repeats

    worst = [_worst(error(r) for r in rows) for rows in repeats]
    relative = [_worst(relative_errors(rows).values()) for rows in repeats]
    kept = []
    for rows in repeats:
        meg = next((r for r in rows if r["label"] == "megatron"), None)
        mine = next(r for r in rows if r["kept"])
        kept.append(meg["measured_s"] / mine["measured_s"] if meg else float("nan"))
    out = {"size": args.size, "microbatches": args.microbatches, "repeats": len(repeats)}
    figures = {
        "candidate_prediction_error": worst,
        "candidate_relative_error": relative,
        "kept_vs_megatron_candidate": kept,
    }
    for key, values in figures.items():
        out[key], out[key + "_min"], out[key + "_max"] = over_repeats(values)
    out["megatron_relative_error"] = [relative_errors(r).get("megatron") for r in repeats]
    out["candidates"] = repeats
    out["argv"] = job_argv(args, layout_warmup)
    return out


if __name__ == "__main__":
    sys.exit(main())

"""What gloo's one-rank DDP collectives cost a step: each run twice in the same 2-process job,
with `patches/one_rank_collectives_on_cpu.py` (the bucket all-gather and reduce-scatter skipped
on a one-rank group) and with upstream's calls into gloo, steps taken in turn.

    python tools/bench_one_rank_collectives.py [--size tiny|medium] [--steps 6] [--repeats 3]
        [--json]

The jobs are bench_runtime.py's (bf16, distributed optimizer, overlapped reduction and
gathers, 2 ranks, pipeline 2 so every DP group has one rank): our executor on the Megatron
schedule, static Optimus and megatron-core's own 1F1B. Prints, per run, the median step and the
steps' spread ((max - min) / median) with and without the patch, and upstream / patched.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RUNS = ("executor_megatron", "optimus", "megatron_core_1f1b")
NAMES = ("dist_all_gather_func", "dist_reduce_scatter_func")


def _use(patched: bool) -> None:
    """megatron-core's bucket collectives: the patch's, or the gloo calls it wraps."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    for name in NAMES:
        fn = getattr(buffers, name)
        wrapped = getattr(fn, "__wrapped__", fn)
        setattr(buffers, name, fn if patched else wrapped)
        if patched and fn is wrapped:
            raise RuntimeError(f"{name} is not patched")


def _steps(rank: int, world: int, jobs: list, steps: int) -> list[list[float]]:
    """Each job twice (patched, upstream), steps in turn, the order rotated each step; every
    run's step seconds on this rank."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.runs import make_run, turn_order

    device = init_rank(rank, world, jobs[0].data.seed, jobs[0].timeout_s)
    patched = {name: getattr(buffers, name) for name in NAMES}
    runs = []
    for job in jobs:
        for flag in (True, False):
            runs.append((flag, make_run(rank, world, job, device)))
    for step in range(steps):
        for i in turn_order(len(runs), step):
            flag, run = runs[i]
            for name in NAMES:
                setattr(buffers, name, patched[name])
            _use(flag)
            dist.barrier()
            run.step(step)
    for name in NAMES:
        setattr(buffers, name, patched[name])
    dist.barrier()
    return [run.result()["seconds"] for _, run in runs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "medium"])
    ap.add_argument("--steps", type=int, default=6, help="measured steps (one more warms up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from bench_runtime import plan_runs

    from megatron_mllm.models.config import BENCH, BENCH_MEDIUM
    from megatron_mllm.runtime.assembly.launch import spawn

    cfg = {"tiny": BENCH, "medium": BENCH_MEDIUM}[args.size]
    setup_args = argparse.Namespace(
        microbatches=8, micro_batch=1, fill_granularity="layer", ddp_bucket_size=2_000_000,
        encoder_wgrad_split=False, plan_candidates=2, plan_candidate_steps=5,
        steps=args.steps, precision="bf16",
    )  # fmt: skip
    setup = plan_runs(setup_args, cfg, torch.bfloat16)
    jobs = [setup["jobs"][name] for name in RUNS]
    repeats = []
    for _ in range(args.repeats):
        per_rank = spawn(_steps, 2, jobs, args.steps + 1)
        one = {}
        for k, name in enumerate(RUNS):
            for j, label in enumerate(("patched", "upstream")):
                i = 2 * k + j
                step = [max(r[i][s] for r in per_rank) for s in range(1, args.steps + 1)]
                med = statistics.median(step)
                one[f"{name}_{label}_s"] = med
                one[f"{name}_{label}_spread"] = (max(step) - min(step)) / med
            one[f"{name}_upstream_vs_patched"] = (
                one[f"{name}_upstream_s"] / one[f"{name}_patched_s"]
            )
        repeats.append(one)
    out = {"size": args.size, "repeats": args.repeats, "steps": args.steps}
    for key in repeats[0]:
        values = [r[key] for r in repeats]
        out[key] = statistics.median(values)
        out[key + "_range"] = [min(values), max(values)]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.size}, {args.repeats} repeats x {args.steps} steps: median (min-max)")
    for name in RUNS:
        for label in ("patched", "upstream"):
            key = f"{name}_{label}"
            lo, hi = out[key + "_s_range"]
            print(
                f"  {key:30s} step {out[key + '_s']:.3f} s ({lo:.3f}-{hi:.3f}), "
                f"spread {out[key + '_spread']:.1%}"
            )
        key = f"{name}_upstream_vs_patched"
        lo, hi = out[key + "_range"]
        print(f"  {key:30s} {out[key]:.3f} ({lo:.3f}-{hi:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What gloo's one-rank DDP collectives cost a step: each run twice in the same 2-process job,
with `patches/one_rank_collectives_on_cpu.py` ("remedied": the bucket all-gather and
reduce-scatter skipped on a one-rank group, where they are the identity) and with upstream's
calls into gloo ("upstream"), steps taken in turn, the order rotated each step.

    python tools/bench_one_rank_collectives.py [--size tiny|medium] [--steps 6] [--repeats 3]
        [--json]

The jobs are bench_runtime.py's (bf16, distributed optimizer, overlapped reduction and gathers,
2 ranks, pipeline 2, so every DP group has one rank): our executor on the Megatron schedule,
static Optimus and megatron-core's own 1F1B. Prints, per run, the median step (the slower
rank's) with and without the patch, the steps' spread ((max - min) / median), the minor page
faults a step (the rank with more) and upstream / remedied: medians over repeats (min-max).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RUNS = ("executor_megatron", "optimus", "megatron_core_1f1b")
NAMES = ("dist_all_gather_func", "dist_reduce_scatter_func")
ARMS = ("remedied", "upstream")


def _use(patched: dict, remedied: bool) -> None:
    """megatron-core's bucket collectives: the patch's (`patched`, by name), or the gloo calls
    they wrap."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    for name, fn in patched.items():
        setattr(buffers, name, fn if remedied else fn.__wrapped__)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _steps(rank: int, world: int, jobs: list, steps: int) -> list:
    """Every job twice (remedied, upstream), steps in turn, the order rotated each step; per
    run this rank's (step seconds, page faults a step)."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.runs import make_run, turn_order

    device = init_rank(rank, world, jobs[0].data.seed, jobs[0].timeout_s)  # applies the patch
    patched = {name: getattr(buffers, name) for name in NAMES}
    runs = [(arm, make_run(rank, world, job, device)) for job in jobs for arm in ARMS]
    faults = [[] for _ in runs]
    for step in range(steps):
        for i in turn_order(len(runs), step):
            arm, run = runs[i]
            _use(patched, arm == "remedied")
            dist.barrier()
            before = _faults()
            run.step(step)
            faults[i].append(_faults() - before)
    _use(patched, True)
    dist.barrier()
    return [(run.result()["seconds"], f) for (_, run), f in zip(runs, faults, strict=True)]


def _one_repeat(jobs: list, steps: int) -> dict:
    """Per run and arm: the median step, the spread, the page faults a step."""
    from megatron_mllm.runtime.assembly.launch import spawn

    per_rank = spawn(_steps, 2, jobs, steps)
    by_arm = {arm: [[r[2 * k + j] for r in per_rank] for k in range(len(jobs))]
              for j, arm in enumerate(ARMS)}  # fmt: skip
    out = {}
    for arm, per_job in by_arm.items():
        for name, ranks in zip(RUNS, per_job, strict=True):
            step = [max(r[0][s] for r in ranks) for s in range(1, steps)]
            med = statistics.median(step)
            out[f"{name}_{arm}_s"] = med
            out[f"{name}_{arm}_spread"] = (max(step) - min(step)) / med
            out[f"{name}_{arm}_faults"] = max(statistics.median(r[1][1:]) for r in ranks)
    for name in RUNS:
        out[f"{name}_upstream_vs_remedied"] = out[f"{name}_upstream_s"] / out[f"{name}_remedied_s"]
    return out


def print_report(out: dict) -> None:
    print(
        f"{out['size']}, {out['repeats']} repeats x {out['steps']} steps: "
        "median (min-max) over repeats"
    )
    for name in RUNS:
        for arm in ARMS:
            key = f"{name}_{arm}"
            lo, hi = out[key + "_s_range"]
            print(
                f"  {key:30s} step {out[key + '_s']:.3f} s ({lo:.3f}-{hi:.3f}), spread "
                f"{out[key + '_spread']:.1%}, page faults a step {out[key + '_faults']:.0f}"
            )
        key = f"{name}_upstream_vs_remedied"
        lo, hi = out[key + "_range"]
        print(f"  {key:30s} {out[key]:.3f} ({lo:.3f}-{hi:.3f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "medium"])
    ap.add_argument("--steps", type=int, default=6, help="measured steps (one more warms up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from bench_common import bench_config
    from bench_runtime import plan_runs

    cfg = bench_config(args.size)
    setup_args = argparse.Namespace(
        microbatches=8, micro_batch=1, fill_granularity="layer", ddp_bucket_size=2_000_000,
        encoder_wgrad_split=False, plan_candidates=2, plan_candidate_steps=5,
        steps=args.steps, precision="bf16",
    )  # fmt: skip
    # `setup` stays alive: dropping it made the fork server refuse a spawn ("too many fds").
    setup = plan_runs(setup_args, cfg, torch.bfloat16)
    jobs = [setup["jobs"][name] for name in RUNS]
    repeats = [_one_repeat(jobs, args.steps + 1) for _ in range(args.repeats)]
    out = {"size": args.size, "repeats": args.repeats, "steps": args.steps}
    for key in repeats[0]:
        values = [r[key] for r in repeats]
        out[key] = statistics.median(values)
        out[key + "_range"] = [min(values), max(values)]
    if args.json:
        print(json.dumps(out))
    else:
        print_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

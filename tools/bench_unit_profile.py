"""How well the start-up unit profile predicts a running job: each unit timed cache-hot (every
repeat right after the last, the old profile) and cold (after a flush of twice the last-level
cache, `profile_units`' default), against the unit times the job itself measures; and the
simulated step of the job's schedule under each, against the step it measures.

    python tools/bench_unit_profile.py [--size tiny|medium] [--repeats 3] [--steps 5] [--json]

Per repeat, in fresh processes: both profiles (both ranks at once, as the benchmarks profile),
then one run of the job bench_runtime.py times (bf16, distributed optimizer, overlapped
reduction and gathers, PP 2 on 2 ranks) on the Optimus plan made from the cold profile. Prints
per unit the job's seconds over each profile's, and each prediction's error against the
measured step (the slower rank's median over the steps after the first; "in-job": the same
schedule simulated on the job's own unit times, what no unit profile can do better than):
medians over repeats (min-max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:
    from megatron_mllm.models.config import MLLMConfig
    from megatron_mllm.schedule.config import MLLMJob
    from megatron_mllm.schedule.planner import Planned
    from megatron_mllm.schedule.workload import Workload

PROFILES = ("hot", "cold")
UNITS = (
    ("vit", "forward", "layer"),
    ("vit", "backward", "layer_b"),
    ("vit", "forward", "projector"),
    ("vit", "backward", "projector_b"),
    ("llm", "forward", "layer"),
    ("llm", "backward", "layer_b"),
    ("llm", "forward", "head"),  # timed apart in the job on the last stage
    ("llm", "backward", "head_b"),
)


def one_repeat(cfg: MLLMConfig, args: argparse.Namespace, state: dict, repeat: int) -> dict:
    """Both profiles and one job run: per unit the job's seconds and each profile's, the
    measured step and each prediction of it."""
    import torch
    from bench_common import bench_run

    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import PlanParts
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.profile_units import profile_units
    from megatron_mllm.runtime.planning.replan import measured_times, measured_workload
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.schedule.planner import plan_optimus
    from megatron_mllm.schedule.simulator import simulate

    plan, bucket = ParallelPlan(1, 1, 2), args.ddp_bucket_size
    order = PROFILES if repeat % 2 == 0 else PROFILES[::-1]  # neither always profiles first
    profiles = {
        name: spawn(profile_units, 2, cfg, 1, 5, torch.bfloat16, bucket, name == "cold")[0]
        for name in order
    }
    run = bench_run(cfg, args, plan, args.microbatches, 1)
    best, _, _ = plan_optimus(JobCosts(run.planning_job(), profiles["cold"], unit="layer"))
    # Every prediction for the same stages: the cold plan's layer split, whatever the times
    planning = replace(run.planning_job(), backbone_split=tuple(best.schedule.meta.backbone_layers))
    job = replace(
        run.runtime_job(None, state),
        steps=args.steps + 1,
        plans=PlanParts(plan, schedule=best.schedule, encoder_units="layer"),
    )
    outs = spawn(run_rank, 2, job)
    samples = [o["unit_times"] for o in outs]
    measured_s = statistics.median(
        max(o["seconds"][s] for o in outs) for s in range(1, args.steps + 1)
    )
    in_job = measured_times(samples, JobCosts(planning, unit="layer"), "layer")
    predicted = {
        name: simulate(best.schedule, _workload(planning, best, times)).step_time_s
        for name, times in profiles.items()
    }
    ran = measured_workload(job, samples)
    predicted["in_job"] = simulate(best.schedule, ran).step_time_s if ran else float("nan")
    units = {
        "/".join(key): {
            "job_s": _unit(in_job, key),
            **{f"{name}_s": _unit(profiles[name], key) for name in PROFILES},
        }
        for key in UNITS
    }
    return {"measured_s": measured_s, "predicted_s": predicted, "units": units}


def _unit(times: dict, key: tuple[str, str, str]) -> float:
    model, direction, name = key
    return times[model][direction][name]


def _workload(planning: MLLMJob, best: Planned, times: dict) -> Workload:
    """The costs of `best`'s schedule under unit `times` (its options and layer split, other
    times)."""
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.schedule.bubble_scheduler import optimus_schedule

    _, workload = optimus_schedule(JobCosts(planning, times, unit="layer"), best.options)
    workload.check_matches(best.schedule.meta)
    return workload


def summarise(repeats: list[dict], args: argparse.Namespace) -> dict:
    """Medians over repeats (min-max) of every unit's job / profile ratio and of each
    prediction's error against the measured step."""

    from bench_common import over_repeats as over

    out: dict = {"size": args.size, "repeats": args.repeats, "steps": args.steps, "units": {}}
    for unit in repeats[0]["units"]:
        rows = [r["units"][unit] for r in repeats]
        out["units"][unit] = {
            "job_s": over([row["job_s"] for row in rows]),
            **{
                f"job_over_{p}": over([row["job_s"] / row[f"{p}_s"] for row in rows])
                for p in PROFILES
            },
        }
    out["measured_s"] = over([r["measured_s"] for r in repeats])
    for name in (*PROFILES, "in_job"):
        errors = [(r["predicted_s"][name] - r["measured_s"]) / r["measured_s"] for r in repeats]
        out[f"{name}_prediction_error"] = over(errors)
    return out


def print_report(result: dict) -> None:
    print(
        f"{result['size']}: {result['repeats']} repeats of {result['steps']} steps; medians "
        "(min-max)"
    )
    print(f"{'unit':<22}{'job ms':>9}{'job / hot':>22}{'job / cold':>22}")
    for unit, row in result["units"].items():
        ratios = "".join(
            f"{row[f'job_over_{p}'][0]:>8.2f} ({row[f'job_over_{p}'][1]:.2f}-"
            f"{row[f'job_over_{p}'][2]:.2f})"
            for p in PROFILES
        )
        print(f"{unit:<22}{1e3 * row['job_s'][0]:>9.2f}{ratios}")
    m = result["measured_s"]
    print(f"measured step {m[0]:.3f} s ({m[1]:.3f}-{m[2]:.3f})")
    for name in (*PROFILES, "in_job"):
        e = result[f"{name}_prediction_error"]
        print(
            f"  predicted from the {name:<7} units: error {e[0]:+.3f} ({e[1]:+.3f} to {e[2]:+.3f})"
        )


def main() -> int:
    from megatron_mllm.errors import OneLineParser

    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="measured steps after a warm-up step")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--ddp-bucket-size", type=int, default=2_000_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.microbatches < 1:
        ap.error("--repeats, --steps and --microbatches must be at least 1")
    args.precision = "bf16"

    from bench_common import bench_config

    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.modes.reference import make_full_state

    cfg = bench_config(args.size)
    state = spawn(make_full_state, 1, cfg, 0)[0]
    result = summarise([one_repeat(cfg, args, state, r) for r in range(args.repeats)], args)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

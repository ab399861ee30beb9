#!/usr/bin/env python
"""Benchmark: real training steps on this machine, 2 ranks x 1 thread, PP=2, a tiny MLLM whose
encoder is about 30% of the compute, 8 micro-batches.

All four run in the same 2-process gloo job, from the same weights and data, taking steps in turn
(A B C D A B C D ...) so machine noise hits them alike:
  megatron_core_1f1b  megatron-core's own 1F1B, encoder on stage 0, Megatron's even layer split
  balanced            the same with the balancing first-stage layer count
  executor_megatron   our executor on the Megatron schedule (balanced split)
  optimus             our executor on the Optimus schedule, planned from measured unit times
  optimus_dynamic     the same, running ready encoder work while waiting for a message
  optimus_replanned   Optimus re-planned after the warm-up step from the unit times it measured
and prints step times (median of the measured steps), the zero-bubble limit (per measured step,
both ranks' compute in the Optimus run summed and divided by 2; the median over the same steps),
the simulator's prediction for each and its error, and the largest loss difference between the
runs. The headline is like for like: Optimus against our executor on the Megatron schedule (the
same executor and split), and against megatron-core's own 1F1B. Every run builds its batches
inside its timed step.

    python tools/bench_runtime.py [--steps 4] [--microbatches 8] [--json] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl|cuda_graph).*")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps (one more warms up)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--ddp-bucket-size", type=int, default=2_000_000, help="parameters per DDP bucket"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--trace",
        default=None,
        help="write the Optimus run's measured trace and the simulator's prediction "
        "as one Chrome trace JSON (processes 'measured rank r' / 'predicted')",
    )
    args = ap.parse_args()
    if args.device == "cuda":  # the ranks then take one GPU each and talk over NCCL
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            print(f"error: --device cuda needs 2 GPUs; this machine has {count}", file=sys.stderr)
            return 2
    elif __import__("torch").cuda.is_available():
        print("error: CUDA is available; run with --device cuda", file=sys.stderr)
        return 2

    from megatron_mllm.models.config import BENCH
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.job import (
        Collect,
        DataParts,
        ExecutorSettings,
        ModelParts,
        OptimizerSettings,
        PlanParts,
        RuntimeJob,
    )
    from megatron_mllm.runtime.launch import spawn
    from megatron_mllm.runtime.profile_units import profile_units
    from megatron_mllm.runtime.reference import make_full_state
    from megatron_mllm.runtime.runs import run_interleaved
    from megatron_mllm.runtime.schedules import job_of
    from megatron_mllm.schedule.baselines import megatron_schedule
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.schedule.planner import plan_optimus
    from megatron_mllm.schedule.simulator import simulate

    cfg, plan, n, mb = BENCH, ParallelPlan(1, 1, 2), args.microbatches, args.micro_batch
    state = spawn(make_full_state, 1, cfg, 0)[0]
    # Both ranks profile at once: the unit times then carry the two-process contention.
    measured = spawn(profile_units, plan.world_size, cfg, mb)[0]
    costs = JobCosts(job_of(cfg, plan, mb, n), measured, unit="layer")
    even = megatron_schedule(costs, even_split=True)
    balanced = megatron_schedule(costs)
    best, _, _ = plan_optimus(costs)
    predicted = {
        "megatron_core_1f1b": simulate(*even).step_time_s,
        "balanced": simulate(*balanced).step_time_s,
        "executor_megatron": simulate(*balanced).step_time_s,
        "optimus": best.result.step_time_s,
        "optimus_dynamic": best.result.step_time_s,  # the simulator runs the static plan
        "optimus_replanned": float("nan"),  # filled in from the run's own re-plan below
    }
    steps = args.steps + 1
    # Our executor's DP reductions are megatron-core's DDP, overlapped as Megatron jobs run them
    # (megatron-core's own schedule reduces after its backward, as its baseline here always has).
    optim = OptimizerSettings(overlap_grad_reduce=True, ddp_bucket_size=args.ddp_bucket_size)
    common = dict(steps=steps, collect=Collect(grads=False), optimizer=optim)
    jobs = {
        "megatron_core_1f1b": RuntimeJob(
            ModelParts(cfg, state),
            PlanParts(plan),
            DataParts(mb, n),
            mode="megatron_core",
            **common,
        ),
        "balanced": RuntimeJob(
            ModelParts(cfg, state),
            PlanParts(plan, backbone_first_stage_layers=balanced[0].meta.backbone_layers[0]),
            DataParts(mb, n),
            mode="megatron_core",
            **common,
        ),
        "executor_megatron": RuntimeJob(
            ModelParts(cfg, state),
            PlanParts(plan, schedule=balanced[0]),
            DataParts(mb, n),
            **common,
        ),
        "optimus": RuntimeJob(
            ModelParts(cfg, state),
            PlanParts(plan, schedule=best.schedule),
            DataParts(mb, n),
            **common,
        ),
        "optimus_dynamic": RuntimeJob(
            ModelParts(cfg, state),
            PlanParts(plan, schedule=best.schedule),
            DataParts(mb, n),
            executor=ExecutorSettings(dynamic=True),
            **common,
        ),
        # Re-planned after the warm-up step from this run's own measured unit times (both
        # ranks, under the contention they really see): balances the ranks on what they cost.
        "optimus_replanned": RuntimeJob(
            ModelParts(cfg, state),
            PlanParts(plan, schedule=best.schedule),
            DataParts(mb, n),
            executor=ExecutorSettings(replan_after=1),
            **common,
        ),
    }
    per_rank = spawn(run_interleaved, plan.world_size, list(jobs.values()), steps)
    measured_s, spread, losses, outs = {}, {}, {}, {}
    for i, name in enumerate(jobs):
        out = [rank_results[i] for rank_results in per_rank]
        outs[name] = out
        per_step = [max(o["seconds"][s] for o in out) for s in range(1, steps)]
        measured_s[name] = statistics.median(per_step)
        spread[name] = (min(per_step), max(per_step))
        losses[name] = {k: v for o in out for k, v in o["losses"].items()}
    if outs["optimus_replanned"][0]["replan_predicted_s"] is not None:
        predicted["optimus_replanned"] = outs["optimus_replanned"][0]["replan_predicted_s"]
    # The limit from the same measured steps as the medians: each step's compute on every rank.
    limit = statistics.median(
        sum(o["compute_seconds"][s] for o in outs["optimus"]) / plan.world_size
        for s in range(1, steps)
    )
    keys = losses["megatron_core_1f1b"].keys()
    diff = max(abs(losses[a][k] - losses["megatron_core_1f1b"][k]) for a in losses for k in keys)
    if args.trace:
        from megatron_mllm.schedule.trace import chrome_trace_events

        real = [sp for o in outs["optimus"] for sp in o["spans"]]
        sim = simulate(best.schedule, best.workload, keep_spans=True)
        events = chrome_trace_events(real, "measured")
        for e in chrome_trace_events(sim.spans, "predicted"):
            e["pid"] = e.get("pid", 0) + 100
            events.append(e)
        with open(args.trace, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    result = {
        "megatron_core_1f1b_s": measured_s["megatron_core_1f1b"],
        "balanced_s": measured_s["balanced"],
        "executor_megatron_s": measured_s["executor_megatron"],
        "optimus_s": measured_s["optimus"],
        "optimus_dynamic_s": measured_s["optimus_dynamic"],
        "optimus_replanned_s": measured_s["optimus_replanned"],
        "limit_s": limit,
        "optimus_vs_executor_megatron": measured_s["executor_megatron"] / measured_s["optimus"],
        "optimus_vs_megatron_core": measured_s["megatron_core_1f1b"] / measured_s["optimus"],
        "optimus_over_limit": measured_s["optimus"] / limit,
        "predicted_error_optimus": (predicted["optimus"] - measured_s["optimus"])
        / measured_s["optimus"],
        "max_abs_loss_diff": diff,
        "predicted_s": predicted,
        "step_range_s": spread,
        "encoder_plan": str(best.options.encoder_plan),
        "encoder_placement": best.options.placement,
        "balanced_first_stage_layers": balanced[0].meta.backbone_layers[0],
        "microbatches": n,
        "measured_steps": args.steps,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    base = result["megatron_core_1f1b_s"]
    print(
        f"tiny MLLM (ViT {cfg.vit_layers}x{cfg.vit_hidden}, GPT {cfg.llm_layers}x"
        f"{cfg.llm_hidden}), PP=2 on 2 ranks x 1 thread, {n} micro-batches; Optimus plan: "
        f"encoder {result['encoder_plan']} ({result['encoder_placement']})"
    )
    print(
        f"{'run':<20}{'step s':>9}{'min-max':>14}{'vs mcore':>10}{'predicted s':>13}"
        f"{'pred. err':>10}"
    )
    for name in jobs:
        s, p, (lo, hi) = measured_s[name], predicted[name], spread[name]
        print(
            f"{name:<20}{s:>9.3f}{lo:>7.3f}-{hi:<6.3f}{base / s:>9.2f}x{p:>13.3f}"
            f"{100 * (p - s) / s:>9.1f}%"
        )
    print(f"{'zero-bubble limit':<20}{limit:>9.3f}{'':>14}{base / limit:>9.2f}x")
    print(
        f"like for like (same executor, same split): optimus vs executor_megatron "
        f"{result['optimus_vs_executor_megatron']:.2f}x; vs megatron-core 1F1B "
        f"{result['optimus_vs_megatron_core']:.2f}x; vs balanced "
        f"{measured_s['balanced'] / measured_s['optimus']:.2f}x; optimus / limit = "
        f"{result['optimus_over_limit']:.3f}; max |loss diff| {diff:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

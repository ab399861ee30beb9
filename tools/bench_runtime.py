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

With --data-path (and --tokenizer-model), or --images-per-sample DIST (LLaVA digits drawn from
DIST, made in a temporary folder), it runs the varying-load benchmark instead
(tools/bench_varying_load.py): real conversations whose micro-batches hold different numbers
of images, static Optimus against optimus-adaptive (each step planned for its own images).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings

from megatron_mllm.errors import exit_on_config_error

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl|cuda_graph).*")


@exit_on_config_error
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps (one more warms up)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--ddp-bucket-size", type=int, default=2_000_000, help="parameters per DDP bucket"
    )
    ap.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default="bf16",
        help="bf16: every run with bf16 parameters, megatron-core's distributed optimizer, "
        "overlapped gradient reduce-scatter and parameter all-gather, fp32 gradient reduction "
        "(as Megatron recipes run); fp32: replicated fp32 Adam, overlapped all-reduce",
    )
    ap.add_argument(
        "--data-path",
        default=None,
        help="the varying-load benchmark instead: a LLaVA-format energon dataset (e.g. from "
        "tools/make_llava_digits.py + tools/llava_to_energon.py) whose samples hold 0-2 "
        "images: megatron-core 1F1B, balanced, static Optimus and optimus-adaptive",
    )
    ap.add_argument("--tokenizer-model", default=None, help="with --data-path: its tokenizer")
    ap.add_argument(
        "--images-per-sample",
        default=None,
        metavar="DIST",
        help="the varying-load benchmark on LLaVA digits whose image counts are drawn from DIST "
        "(e.g. 0:0.2,1:0.3,4:0.3,8:0.2), made in a temporary folder; instead of --data-path",
    )
    ap.add_argument("--records", type=int, default=400, help="with --images-per-sample")
    ap.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="with --data-path: every run with a per-token loss; optimus-adaptive then also "
        "deals each step's samples into micro-batches of equal images (and optimus_balanced "
        "does so under the static plan)",
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

    if args.data_path is not None and args.images_per_sample is not None:
        print("error: give --data-path or --images-per-sample, not both", file=sys.stderr)
        return 2
    if args.data_path is not None or args.images_per_sample is not None:
        from bench_varying_load import varying_load

        return varying_load(args)
    from megatron_mllm.models.config import BENCH
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.job import (
        Collect,
        DataParts,
        ExecutorSettings,
        ModelParts,
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
    import torch

    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    measured = spawn(profile_units, plan.world_size, cfg, mb, 5, dtype)[0]
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
    # Every run: megatron-core's DDP (overlapped, as Megatron jobs run it) and optimizer, the
    # same settings for megatron-core's own 1F1B and for our executor.
    from bench_common import bench_optimizer

    optim = bench_optimizer(args)
    common = dict(steps=steps, collect=Collect(grads=False), optimizer=optim)
    jobs = {
        "megatron_core_1f1b": RuntimeJob(
            ModelParts(cfg, state, precision=args.precision),
            PlanParts(plan),
            DataParts(mb, n),
            mode="megatron_core",
            **common,
        ),
        "balanced": RuntimeJob(
            ModelParts(cfg, state, precision=args.precision),
            PlanParts(plan, backbone_first_stage_layers=balanced[0].meta.backbone_layers[0]),
            DataParts(mb, n),
            mode="megatron_core",
            **common,
        ),
        "executor_megatron": RuntimeJob(
            ModelParts(cfg, state, precision=args.precision),
            PlanParts(plan, schedule=balanced[0]),
            DataParts(mb, n),
            **common,
        ),
        "optimus": RuntimeJob(
            ModelParts(cfg, state, precision=args.precision),
            PlanParts(plan, schedule=best.schedule),
            DataParts(mb, n),
            **common,
        ),
        "optimus_dynamic": RuntimeJob(
            ModelParts(cfg, state, precision=args.precision),
            PlanParts(plan, schedule=best.schedule),
            DataParts(mb, n),
            executor=ExecutorSettings(dynamic=True),
            **common,
        ),
        # Re-planned after the warm-up step from this run's own measured unit times (both
        # ranks, under the contention they really see): balances the ranks on what they cost.
        "optimus_replanned": RuntimeJob(
            ModelParts(cfg, state, precision=args.precision),
            PlanParts(plan, schedule=best.schedule),
            DataParts(mb, n),
            executor=ExecutorSettings(replan_after=1),
            **common,
        ),
    }
    per_rank = spawn(run_interleaved, plan.world_size, list(jobs.values()), steps)
    measured_s, spread, losses, outs, dp_share = {}, {}, {}, {}, {}
    for i, name in enumerate(jobs):
        out = [rank_results[i] for rank_results in per_rank]
        outs[name] = out
        per_step = [max(o["seconds"][s] for o in out) for s in range(1, steps)]
        measured_s[name] = statistics.median(per_step)
        spread[name] = (min(per_step), max(per_step))
        losses[name] = {k: v for o in out for k, v in o["losses"].items()}
        dp_share[name] = statistics.median(  # the rank that waited longest, per step
            max(o["dp_seconds"][s] / o["seconds"][s] for o in out) for s in range(1, steps)
        )
    memory = measure_memory(
        jobs,
        plan,
        {
            "megatron_core_1f1b": even,
            "balanced": balanced,
            "executor_megatron": balanced,
            "optimus": (best.schedule, best.workload),
        },
    )
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
        "dp_unhidden_share": dp_share,
        "memory": memory,
        "precision": args.precision,
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
        "DP communication not hidden (share of the step, slowest rank): "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in dp_share.items())
    )
    print(
        f"{'memory per rank (MB)':<28}{'params':>8}{'grads':>8}{'optim':>8}{'acts':>8}"
        f"{'total':>8}{'planned':>9}{'ratio':>7}"
    )
    for name, ranks in memory.items():
        for r, m in enumerate(ranks):
            print(
                f"{name + ' r' + str(r):<28}"
                + "".join(f"{m[k] / 1e6:>8.2f}" for k in ("params", "grads", "optimizer"))
                + f"{m['activations'] / 1e6:>8.2f}{m['total'] / 1e6:>8.2f}"
                f"{m['planned_total'] / 1e6:>9.2f}{m['total'] / m['planned_total']:>7.2f}"
            )
    print(
        f"like for like (same executor, same split): optimus vs executor_megatron "
        f"{result['optimus_vs_executor_megatron']:.2f}x; vs megatron-core 1F1B "
        f"{result['optimus_vs_megatron_core']:.2f}x; vs balanced "
        f"{measured_s['balanced'] / measured_s['optimus']:.2f}x; optimus / limit = "
        f"{result['optimus_over_limit']:.3f}; max |loss diff| {diff:.2e}"
    )
    return 0


def measure_memory(jobs: dict, plan, planned: dict) -> dict:
    """One more step of each run with memory measured (saved-tensor hooks slow a step, so not
    in the timed ones), next to the planner's estimate for its schedule: per rank, bytes."""
    from dataclasses import replace

    from megatron_mllm.runtime.job import Collect
    from megatron_mllm.runtime.launch import spawn
    from megatron_mllm.runtime.memory import planned_memory
    from megatron_mllm.runtime.runs import run_interleaved

    names = list(planned)
    probes = [replace(jobs[n], steps=1, collect=Collect(grads=False, memory=True)) for n in names]
    per_rank = spawn(run_interleaved, plan.world_size, probes, 1)
    out = {}
    for i, name in enumerate(names):
        estimate = planned_memory(*planned[name])
        out[name] = []
        for r, ranks in enumerate(per_rank):
            m = dict(ranks[i]["memory"])
            m["total"] = sum(m[k] for k in ("params", "grads", "optimizer", "activations"))
            m["planned_state"] = estimate[r]["state"]
            m["planned_activations"] = estimate[r]["activations"]
            m["planned_total"] = m["planned_state"] + m["planned_activations"]
            out[name].append(m)
    return out


if __name__ == "__main__":
    sys.exit(main())

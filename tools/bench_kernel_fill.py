#!/usr/bin/env python
"""Benchmark: kernel-level bubble filling at run time, and the frozen encoder, on this machine.

A TP=2 tiny MLLM on 2 ranks x 1 thread; every run in the same gloo job, from the same weights
and data, taking steps in turn (A B C ... A B C ...) so machine noise hits them alike:
  megatron              our executor, encoder on stage 0 (Megatron's placement), layer units
  optimus_layer         Optimus planned at layer granularity (encoder layers fill TP bubbles)
  optimus_kernel        Optimus planned at kernel granularity (ln1, qkv, attn, proj, ln2, fc1,
                        act, fc2 ... fill TP bubbles)
  optimus_overlap       optimus_kernel with its TP-bubble fills run while the backbone's TP
                        collectives are in flight (patches/async_tp_collectives.py)
  frozen_megatron       a frozen encoder (forward only, projector trains), Megatron placement
  frozen_optimus        the same frozen encoder under Optimus, kernel granularity
  two_megatron          two encoders (the second a ViT of half the width and depth, at half the
                        image size), both on stage 0
  two_optimus           the same two encoders under Optimus, kernel granularity
  sp_megatron           megatron with sequence parallelism (the backbone's TP collectives are
                        all-gathers and reduce-scatters of [s/tp, b, h] activations)
  sp_overlap            optimus_overlap with sequence parallelism: fills run inside those
  optimus_replanned     optimus_overlap re-planned online after half the steps from the unit
                        and TP-collective times it measured (step time before / after, and the
                        simulator's prediction for the new plan under those times)
Prints the median step time, the simulator's prediction (analytic CPU cost model) and its error,
the simulator's prediction for the same schedule on the unit and TP-collective times measured in
the run ("on measured"), and the largest loss difference between runs that train the same
parameters.


    python tools/bench_kernel_fill.py [--model bench|tiny] [--steps 4] [--microbatches 4] [--json]

On the BENCH model the planner (CPU cost model) finds no TP bubble worth filling; on the TINY
model, where the all-reduce latency matters more, it places encoder kernels into TP bubbles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from dataclasses import replace

warnings.filterwarnings("ignore", message=".*absl.*")


def second_encoder(cfg):
    """A second ViT: half the width and depth, at half the image size (same token count)."""
    from megatron_mllm.models.config import MLLMConfig

    return MLLMConfig(
        image_size=cfg.image_size // 2,
        patch_size=cfg.patch_size // 2,
        vit_layers=max(1, cfg.vit_layers // 2),
        vit_hidden=cfg.vit_hidden // 2,
        vit_heads=max(1, cfg.vit_heads // 2),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="measured steps (one more warms up)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--model", choices=["bench", "tiny"], default="bench")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from bench_common import bench_run

    from megatron_mllm.models.config import BENCH, TINY
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.modes.runs import run_interleaved
    from megatron_mllm.runtime.planning.replan import predicted_with_measured
    from megatron_mllm.schedule.simulator import simulate

    cfg, plan, n = (
        BENCH if args.model == "bench" else TINY,
        ParallelPlan(1, 2, 1),
        args.microbatches,
    )
    steps = args.steps + 1
    runs = {  # name: (schedule name, unit, frozen, sequence parallel)
        "megatron": ("megatron", "layer", False, False),
        "optimus_layer": ("optimus", "layer", False, False),
        "optimus_kernel": ("optimus", "kernel", False, False),
        "optimus_overlap": ("optimus", "kernel", False, False),
        "frozen_megatron": ("megatron", "layer", True, False),
        "frozen_optimus": ("optimus", "kernel", True, False),
        "two_megatron": ("megatron", "layer", False, False),
        "two_optimus": ("optimus", "kernel", False, False),
        "sp_megatron": ("megatron", "layer", False, True),
        "sp_overlap": ("optimus", "kernel", False, True),
        "optimus_replanned": ("optimus", "kernel", False, False),
    }
    two = replace(cfg, extra_encoders=(second_encoder(cfg),))
    state = spawn(make_full_state, 1, cfg, 0)[0]
    two_state = spawn(make_full_state, 1, two, 0)[0]
    replan_at = 1 + args.steps // 2  # steps 1 .. replan_at-1 before, the rest after
    jobs, predicted, fills = {}, {}, {}
    fp32 = argparse.Namespace(precision="fp32")
    for name, (schedule_name, unit, frozen, sp) in runs.items():
        model = two if name.startswith("two") else cfg
        flags = ["--bubble-schedule", schedule_name, "--fill-granularity", unit]
        flags += ["--freeze-ViT"] * frozen + ["--sequence-parallel"] * sp
        flags += ["--overlap-tp-fills"] * name.endswith(("_overlap", "_replanned"))
        # No optimizer step (--lr 0): the schedules' own time, fp32, DDP as Megatron runs it.
        run = bench_run(model, fp32, plan, n, 1, "--lr", "0", *flags)
        schedule, workload = run.static_plan()
        predicted[name] = simulate(schedule, workload).step_time_s
        fills[name] = sum("@tp" in str(a) for rank in schedule.ranks for a in rank)
        job = run.runtime_job(schedule, two_state if model is two else state)
        replan = replan_at if name == "optimus_replanned" else None
        jobs[name] = replace(job, steps=steps, executor=replace(job.executor, replan_after=replan))
    per_rank = spawn(run_interleaved, plan.world_size, list(jobs.values()), steps)
    measured, spread, losses, calibrated = {}, {}, {}, {}
    for i, name in enumerate(jobs):
        out = [rank_results[i] for rank_results in per_rank]
        calibrated[name] = predicted_with_measured(jobs[name], [o["unit_times"] for o in out])
        per_step = [max(o["seconds"][s] for o in out) for s in range(1, steps)]
        measured[name] = statistics.median(per_step)
        spread[name] = (min(per_step), max(per_step))
        losses[name] = {k: v for o in out for k, v in o["losses"].items()}
        if name == "optimus_replanned":
            before, after = per_step[: replan_at - 1], per_step[replan_at - 1 :]
            replanned = {
                "replanned": out[0]["replanned"],
                "before_s": statistics.median(before),
                "after_s": statistics.median(after),
                "predicted_after_s": out[0]["replan_predicted_s"],
            }

    def diff(names):
        keys = losses[names[0]].keys()
        return max(abs(losses[a][k] - losses[names[0]][k]) for a in names for k in keys)

    result = {
        **{f"{name}_s": measured[name] for name in runs},
        "predicted_s": predicted,
        "predicted_measured_s": calibrated,
        "step_range_s": spread,
        "tp_fills": fills,
        "max_abs_loss_diff_trained": diff(
            [
                "megatron",
                "optimus_layer",
                "optimus_kernel",
                "optimus_overlap",
                "optimus_replanned",
                "sp_megatron",
                "sp_overlap",
            ]
        ),
        "max_abs_loss_diff_frozen": diff(["frozen_megatron", "frozen_optimus"]),
        "max_abs_loss_diff_two_encoders": diff(["two_megatron", "two_optimus"]),
        "replanning": replanned,
        "microbatches": n,
        "measured_steps": args.steps,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"tiny MLLM (ViT {cfg.vit_layers}x{cfg.vit_hidden}, GPT {cfg.llm_layers}x{cfg.llm_hidden})"
        f", TP=2 on 2 ranks x 1 thread, {n} micro-batches"
    )
    print(
        f"{'run':<17}{'step s':>9}{'min-max':>14}{'vs megatron':>13}{'predicted s':>13}"
        f"{'pred. err':>10}{'on measured':>13}{'err':>8}{'TP fills':>10}"
    )
    for name in runs:
        if name == "optimus_replanned":
            continue
        family = name.split("_")[0]  # frozen_*, two_*, sp_* compare with their own megatron run
        base = measured[f"{family}_megatron" if family in ("frozen", "two", "sp") else "megatron"]
        s, p, (lo, hi) = measured[name], predicted[name], spread[name]
        c = calibrated[name]
        on_measured = f"{c:>13.4f}{100 * (c - s) / s:>7.1f}%" if c else f"{'-':>13}{'-':>8}"
        print(
            f"{name:<17}{s:>9.4f}{lo:>7.4f}-{hi:<7.4f}{base / s:>11.2f}x{p:>13.4f}"
            f"{100 * (p - s) / s:>9.1f}%{on_measured}{fills[name]:>10}"
        )
    r = replanned
    print(
        f"online re-planning (optimus, kernel units, overlapped fills, after step "
        f"{replan_at - 1}): "
        f"{'re-planned' if r['replanned'] else 'kept the plan'}; step {r['before_s']:.3f} s "
        f"before, {r['after_s']:.3f} s after ({r['before_s'] / r['after_s']:.2f}x)"
    )
    if r["predicted_after_s"] is not None:
        p, a = r["predicted_after_s"], r["after_s"]
        print(
            f"  the simulator on the measured unit and TP-collective times predicts {p:.3f} s "
            f"for the new plan ({100 * (p - a) / a:+.1f}%)"
        )
    print(
        f"max |loss diff|: trained runs {result['max_abs_loss_diff_trained']:.2e}, frozen runs "
        f"{result['max_abs_loss_diff_frozen']:.2e}, two-encoder runs "
        f"{result['max_abs_loss_diff_two_encoders']:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

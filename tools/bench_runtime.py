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
  optimus_wgrad_split (--encoder-wgrad-split) the Optimus plan with the encoder's backward split
                      into input-gradient and weight-gradient actions (zero-bubble's B / W)
  optimus_bb_split    (--backbone-wgrad-split) the Optimus plan with the backbone's backward
                      split where a pipeline peer waits for it (and the encoder's, with both)
  executor_megatron_bb_split (--backbone-wgrad-split) the ablation: our executor on the
                      Megatron schedule with the same backbone split
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
from megatron_mllm.training.plan_candidates import LAYOUT_WARMUP, STEPS_EACH

warnings.filterwarnings("ignore", message=".*absl.*")


@exit_on_config_error
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps (one more warms up)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="the whole comparison this many times (each in fresh processes); medians and "
        "min-max of every ratio over repeats",
    )
    ap.add_argument(
        "--plan-candidates",
        type=int,
        default=2,
        help="the optimus_candidates run: the planner's K best plans and the Megatron schedule "
        "each train real steps, the fastest measured is kept (pretrain_mllm.py's flag)",
    )
    ap.add_argument(
        "--plan-candidate-steps",
        type=int,
        default=STEPS_EACH,
        help="with --plan-candidates: timed steps per candidate plus one (pretrain_mllm.py's flag)",
    )
    ap.add_argument(
        "--plan-candidate-layout-warmup",
        type=int,
        default=LAYOUT_WARMUP,
        help="with --plan-candidates: warm-up steps on each other module layout "
        "(pretrain_mllm.py's flag; 0: predicted from the first plan's warm-up only)",
    )
    ap.add_argument(
        "--size",
        choices=["tiny", "medium"],
        default="tiny",
        help="tiny: the fast default; medium: compute-bound (a backbone layer's forward about "
        "11 ms in bf16 on one core)",
    )
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument(
        "--fill-granularity",
        choices=["layer", "kernel"],
        default="layer",
        help="the Optimus runs' encoder units (pretrain_mllm.py's flag; the Megatron schedule's "
        "encoder stays whole layers on stage 0)",
    )
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
        "--native-resolution",
        action="store_true",
        help="the varying-load benchmark on LLaVA digits of drawn sizes (16 to 96 px: 16 to 576 "
        "patches of 4) for a native-resolution tower, packed rows, per-token loss, made in a "
        "temporary folder: static Optimus against optimus-adaptive (each step planned for its "
        "patches, samples dealt by them)",
    )
    ap.add_argument(
        "--dp",
        type=int,
        choices=[1, 2],
        default=1,
        help="with the varying-load benchmark: 2 for DP 2 x PP 1 (two replicas, the straggler "
        "layout) instead of PP 2",
    )
    ap.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="with --data-path: every run with a per-token loss; optimus-adaptive then also "
        "deals each step's samples into micro-batches of equal images (and optimus_balanced "
        "does so under the static plan)",
    )
    ap.add_argument(
        "--encoder-wgrad-split",
        action="store_true",
        help="also run the Optimus plan with the encoder's weight gradients split from its "
        "input gradients (optimus_wgrad_split), side by side",
    )
    ap.add_argument(
        "--backbone-wgrad-split",
        action="store_true",
        help="also run the Optimus plan with the backbone's backward split where a pipeline "
        "peer waits for it (optimus_bb_split; with --encoder-wgrad-split the encoder's too), "
        "side by side",
    )
    ap.add_argument(
        "--recv-ablation",
        action="store_true",
        help="also run our executor's Megatron schedule and the static Optimus plan with each "
        "receive posted only when its tensor is needed (recv_lookahead 0; gloo's default posts "
        "every receive with the first), side by side (CPU only)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--trace",
        default=None,
        help="write the Optimus run's measured trace and the simulator's prediction "
        "as one Chrome trace JSON (processes 'measured rank r' / 'predicted')",
    )
    args = ap.parse_args()
    if args.recv_ablation and args.device == "cuda":
        ap.error("--recv-ablation is for gloo (CPU): NCCL's receives were always posted ahead")
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
    from megatron_mllm.errors import ConfigError
    from megatron_mllm.training.plan_candidates import check_counts

    try:
        check_counts(
            args.plan_candidates, args.plan_candidate_steps, args.plan_candidate_layout_warmup
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.data_path is not None or args.images_per_sample is not None or args.native_resolution:
        from bench_varying_load import varying_load

        return varying_load(args)
    import torch
    from bench_common import bench_config

    cfg = bench_config(args.size)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    setup = plan_runs(args, cfg, dtype)
    repeats = [one_repeat(setup, args) for _ in range(args.repeats)]
    memory = measure_memory(setup["jobs"], setup["plan"], setup["planned"])
    result = summarise(setup, repeats, memory, args)
    if args.trace:
        write_trace(args.trace, repeats[-1]["optimus_spans"], setup["best"])
    if args.json:
        print(json.dumps(result))
        return 0
    print_report(result, setup, args)
    return 0


RATIOS = (
    "candidates_vs_executor_megatron",
    "candidates_vs_optimus",
    "candidates_vs_megatron_core",
    "candidate_prediction_error",
    "candidate_prediction_error_fitted",
    "candidate_prediction_error_drift_corrected",
    "candidate_prediction_error_floor",
    "kept_prediction_error",
    "optimus_vs_executor_megatron",
    "optimus_vs_megatron_core",
    "optimus_vs_balanced",
    "optimus_over_limit",
    "megatron_core_over_limit",
    "predicted_error_optimus",
)
# The split variants of the Optimus plan: run name -> (the flag's attribute, what it splits)
SPLITS = {
    "optimus_wgrad_split": ("encoder_wgrad_split", "wgrad_split"),
    "optimus_bb_split": ("backbone_wgrad_split", "backbone_wgrad_split"),
}
SPLIT_RATIOS = tuple(
    f"{name}{suffix}"
    for name in SPLITS
    for suffix in ("_vs_executor_megatron", "_vs_megatron_core", "_vs_optimus", "_over_limit")
) + tuple(f"predicted_error_{name}" for name in SPLITS)
# With --backbone-wgrad-split: Optimus against the Megatron schedule, both with the split (the
# idea alone), and what the split does for the Megatron schedule
SPLIT_RATIOS += (
    "optimus_bb_split_vs_executor_megatron_bb_split",
    "executor_megatron_bb_split_vs_executor_megatron",
    "predicted_error_executor_megatron_bb_split",
)
# With --recv-ablation: a run with receives posted ahead over the same run with each posted
# when needed (step time when needed / ahead: above 1, ahead is faster)
RECV_ABLATED = ("executor_megatron", "optimus")
SPLIT_RATIOS += tuple(f"{name}_recv_ahead_gain" for name in RECV_ABLATED)


def split_variants(args, best, fill_costs) -> dict:
    """Each split variant asked for: run name -> the best plan's options with that split
    (the backbone's goes with the encoder's where both are asked for), planned."""
    from dataclasses import replace

    from megatron_mllm.schedule.bubble_scheduler import optimus_schedule
    from megatron_mllm.schedule.planner import run as simulated

    out = {}
    if best.options.placement != "colocated":
        return out  # the Megatron placement won: nothing to split beside it
    for name, (flag, option) in SPLITS.items():
        if not getattr(args, flag):
            continue
        opts = replace(best.options, **{option: True})
        if option == "backbone_wgrad_split":
            opts = replace(opts, wgrad_split=args.encoder_wgrad_split)
        out[name] = simulated("optimus", optimus_schedule(fill_costs, opts), opts)
    return out


def plan_runs(args, cfg, dtype) -> dict:
    """Profile the units (both ranks at once), plan the schedules and build every run's job."""
    from dataclasses import replace

    from bench_common import bench_run

    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import ExecutorSettings, PlanParts
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.planning.profile_units import profile_units
    from megatron_mllm.schedule.baselines import megatron_schedule
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.schedule.planner import plan_optimus
    from megatron_mllm.schedule.simulator import simulate

    plan, n, mb = ParallelPlan(1, 1, 2), args.microbatches, args.micro_batch
    state = spawn(make_full_state, 1, cfg, 0)[0]
    # Both ranks profile at once: the unit times then carry the two-process contention.
    measured = spawn(profile_units, plan.world_size, cfg, mb, 5, dtype, args.ddp_bucket_size)[0]
    run = bench_run(cfg, args, plan, n, mb)
    costs = JobCosts(run.planning_job(), measured, unit="layer")
    even = megatron_schedule(costs, even_split=True)
    balanced = megatron_schedule(costs)
    unit = args.fill_granularity
    fill_costs = costs.with_unit(unit)
    best, _, _ = plan_optimus(fill_costs)
    predicted = {
        "megatron_core_1f1b": simulate(*even).step_time_s,
        "balanced": simulate(*balanced).step_time_s,
        "executor_megatron": simulate(*balanced).step_time_s,
        "optimus": best.result.step_time_s,
        "optimus_dynamic": best.result.step_time_s,  # the simulator runs the static plan
        "optimus_replanned": float("nan"),  # filled in from the run's own re-plan
    }
    # Every run: megatron-core's DDP (overlapped, as Megatron jobs run it) and optimizer, the
    # same settings for megatron-core's own 1F1B and for our executor.
    base = replace(run.runtime_job(None, state), steps=args.steps + 1)

    def job(plans, **kw):
        return replace(base, plans=plans, **kw)

    def optimus(schedule) -> PlanParts:
        return PlanParts(plan, schedule=schedule, encoder_units=unit)

    first = balanced[0].meta.backbone_layers[0]
    jobs = {
        "megatron_core_1f1b": job(PlanParts(plan), mode="megatron_core"),
        "balanced": job(PlanParts(plan, backbone_first_stage_layers=first), mode="megatron_core"),
        "executor_megatron": job(PlanParts(plan, schedule=balanced[0])),
        "optimus": job(optimus(best.schedule)),
        "optimus_dynamic": job(optimus(best.schedule), executor=ExecutorSettings(dynamic=True)),
        # Re-planned after the warm-up step from this run's own measured unit times (both
        # ranks, under the contention they really see): balances the ranks on what they cost.
        "optimus_replanned": job(optimus(best.schedule), executor=ExecutorSettings(replan_after=1)),
    }
    variants = split_variants(args, best, fill_costs)  # the same encoder plan, split B / W
    for name, split in variants.items():
        jobs[name] = job(optimus(split.schedule))
        predicted[name] = split.result.step_time_s
    if args.backbone_wgrad_split:  # the ablation: the Megatron schedule with the same split
        megatron_split = megatron_schedule(costs, backbone_wgrad_split=True)
        jobs["executor_megatron_bb_split"] = job(PlanParts(plan, schedule=megatron_split[0]))
        predicted["executor_megatron_bb_split"] = simulate(*megatron_split).step_time_s
    for name in RECV_ABLATED if args.recv_ablation else ():
        ablated = replace(jobs[name].executor, recv_lookahead=0)
        jobs[f"{name}_recv_needed"] = replace(jobs[name], executor=ablated)
        predicted[f"{name}_recv_needed"] = predicted[name]
    # Plan candidates (--plan-candidates): the planner's K best and the Megatron schedule each
    # train real steps, the fastest measured is kept; this run's phase goes before the others.
    from functools import partial

    from megatron_mllm.training.candidate_run import CandidateRun
    from megatron_mllm.training.plan_candidates import CandidatePhase
    from megatron_mllm.training.plan_candidates import plan_candidates as candidates_of

    splits = (args.encoder_wgrad_split, args.backbone_wgrad_split)
    cands = tuple(candidates_of(fill_costs, args.plan_candidates, unit, *splits))
    warmup = args.plan_candidate_layout_warmup
    phase = CandidatePhase(cands, args.plan_candidate_steps, layout_warmup=warmup)
    opening = phase.candidates[0]
    jobs["optimus_candidates"] = job(
        PlanParts(plan, schedule=opening.schedule, encoder_units=opening.units)
    )
    predicted["optimus_candidates"] = float("nan")  # the kept candidate's, from the run
    makers = {"optimus_candidates": partial(CandidateRun, phase=phase)}
    # The Megatron schedule's run takes its steps in turn with the phase's: the machine's drift
    # between the warm-up (what the predictions are made from) and each candidate's window.
    lead = {"optimus_candidates": phase.steps, "executor_megatron": phase.steps}
    planned = {
        "megatron_core_1f1b": even,
        "balanced": balanced,
        "executor_megatron": balanced,
        "optimus": (best.schedule, best.workload),
    }
    for name, split in variants.items():
        planned[name] = (split.schedule, split.workload)
    if args.backbone_wgrad_split:
        planned["executor_megatron_bb_split"] = megatron_split
    return dict(
        cfg=cfg,
        plan=plan,
        n=n,
        jobs=jobs,
        planned=planned,
        best=best,
        balanced=balanced,
        predicted=predicted,
        makers=makers,
        lead=lead,
        phase=phase,
        dp_gbps=measured.get("dp", {}).get("gbps", {}),  # what the start-up plans priced DP at
    )


def worst_error(rows: list[dict], key: str) -> float:
    """The largest |predicted - measured| / measured over the candidates that ran."""
    return max(abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rows)


def drift_corrected(rows: list[dict], steps: dict, ran: list, phase) -> list[dict]:
    """The candidates' rows with each prediction scaled by the machine's drift from the
    calibration steps to that candidate's timed steps, as the Megatron schedule's run (stepping
    in turn with the phase; `steps`: `phase_steps`) measured it: what the prediction would be
    on the machine as it was when the candidate ran. `ran`: the phase's windows as they ran."""
    from megatron_mllm.training.plan_candidates import timed_steps

    ref = steps["executor_megatron"]
    timed, reads = timed_steps(ran, phase.warmup_steps), phase.read_steps()
    out = []
    for i, row in enumerate(rows):
        read = reads.get(phase.layout_of(i), reads[phase.layout_of(0)])  # not warmed: the first
        base = statistics.median(ref[s] for s in read)
        mine = timed.get(i, [])
        drift = statistics.median(ref[s] for s in mine) / base if mine else float("nan")
        out.append({**row, "predicted_s": row["predicted_s"] * drift, "drift": drift})
    return out


def window_floor(rows: list[dict], steps: dict, ran: list, phase) -> float:
    """The prediction error the machine itself allows: over the candidates timed in two windows,
    the largest |first window's median - measured| / measured, i.e. how far a plan's own
    measurement minutes earlier misses its measurement (`steps`: `phase_steps`; `ran`: the
    phase's windows as they ran)."""
    from megatron_mllm.training.plan_candidates import timed_windows

    seconds = steps["optimus_candidates"]
    errors = [
        abs(statistics.median(seconds[s] for s in first) - rows[i]["measured_s"])
        / rows[i]["measured_s"]
        for i, (first, *later) in timed_windows(ran, phase.warmup_steps).items()
        if later
    ]
    return max(errors, default=float("nan"))


def phase_steps(outs: dict, phase) -> dict:
    """Every step of the candidate phase (the slowest rank's seconds), which candidate took it,
    and the Megatron schedule's run's step taken beside it: where the phase's time went."""
    return {
        name: [max(o["seconds"][s] for o in outs[name]) for s in range(phase.steps)]
        for name in ("optimus_candidates", "executor_megatron")
    } | {"candidate_of_step": outs["optimus_candidates"][0]["candidate_of_step"][: phase.steps]}


def one_repeat(setup: dict, args) -> dict:
    """One whole comparison: every run in the same 2-process job, steps taken in turn."""
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.engine.breakdown import StepBreakdown, summary
    from megatron_mllm.runtime.modes.runs import run_interleaved

    jobs, plan, steps = setup["jobs"], setup["plan"], args.steps + 1
    makers = [setup["makers"].get(name) for name in jobs]
    lead = [setup["lead"].get(name, 0) for name in jobs]
    per_rank = spawn(  # one repeat of every run at medium takes 10-15 minutes
        run_interleaved, plan.world_size, list(jobs.values()), steps, makers, lead, timeout_s=3600
    )
    out: dict = {"measured_s": {}, "spread": {}, "losses": {}, "dp_share": {}, "breakdown": {}}
    outs = {}
    for i, name in enumerate(jobs):
        ranks = [rank_results[i] for rank_results in per_rank]
        outs[name] = ranks
        timed = range(lead[i] + 1, lead[i] + steps)  # the steps all runs took side by side
        per_step = [max(o["seconds"][s] for o in ranks) for s in timed]
        out["measured_s"][name] = statistics.median(per_step)
        out["spread"][name] = (min(per_step), max(per_step))
        out["losses"][name] = {k: v for o in ranks for k, v in o["losses"].items()}  # step 0
        out["dp_share"][name] = statistics.median(  # the rank that waited longest, per step
            max(o["dp_seconds"][s] / o["seconds"][s] for o in ranks) for s in timed
        )
        out["breakdown"][name] = [
            summary([StepBreakdown(**_fields(o["breakdowns"][s])) for s in timed]) for o in ranks
        ]
    out["candidates"] = outs["optimus_candidates"][0]["candidates"]
    out["candidate_build_s"] = outs["optimus_candidates"][0]["candidate_build_s"]
    out["calibration"] = outs["optimus_candidates"][0]["candidate_calibration"]
    out["phase_steps"] = phase_steps(outs, setup["phase"])
    out["second_look"] = outs["optimus_candidates"][0]["candidate_second_look"]
    replanned = outs["optimus_replanned"][0]["replan_predicted_s"]
    out["replan_predicted_s"] = replanned if replanned is not None else float("nan")
    # The limit from the same measured steps as the medians: each step's compute on every rank.
    out["limit_s"] = statistics.median(
        sum(o["compute_seconds"][s] for o in outs["optimus"]) / plan.world_size
        for s in range(1, steps)
    )
    m, limit = out["measured_s"], out["limit_s"]
    kept = next(r for r in out["candidates"] if r["kept"])
    ran = outs["optimus_candidates"][0]["candidate_windows"]
    out["ratios"] = {
        "candidates_vs_executor_megatron": m["executor_megatron"] / m["optimus_candidates"],
        "candidates_vs_optimus": m["optimus"] / m["optimus_candidates"],
        "candidates_vs_megatron_core": m["megatron_core_1f1b"] / m["optimus_candidates"],
        "candidate_prediction_error": worst_error(out["candidates"], "predicted_s"),
        # the ablation: one latency per message fitted to the warm-up steps, as before
        "candidate_prediction_error_fitted": worst_error(out["candidates"], "predicted_fitted_s"),
        "candidate_prediction_error_drift_corrected": worst_error(
            drift_corrected(out["candidates"], out["phase_steps"], ran, setup["phase"]),
            "predicted_s",
        ),
        "candidate_prediction_error_floor": window_floor(
            out["candidates"], out["phase_steps"], ran, setup["phase"]
        ),
        "kept_prediction_error": (kept["predicted_s"] - m["optimus_candidates"])
        / m["optimus_candidates"],
        "optimus_vs_executor_megatron": m["executor_megatron"] / m["optimus"],
        "optimus_vs_megatron_core": m["megatron_core_1f1b"] / m["optimus"],
        "optimus_vs_balanced": m["balanced"] / m["optimus"],
        "optimus_over_limit": m["optimus"] / limit,
        # about the most any schedule of this work could measure against megatron-core
        "megatron_core_over_limit": m["megatron_core_1f1b"] / limit,
        "predicted_error_optimus": (setup["predicted"]["optimus"] - m["optimus"]) / m["optimus"],
    }
    for name in (n for n in SPLITS if n in m):
        split, ratios = m[name], out["ratios"]
        ratios[f"{name}_vs_executor_megatron"] = m["executor_megatron"] / split
        ratios[f"{name}_vs_megatron_core"] = m["megatron_core_1f1b"] / split
        ratios[f"{name}_vs_optimus"] = m["optimus"] / split
        ratios[f"{name}_over_limit"] = split / limit  # the same work
        ratios[f"predicted_error_{name}"] = (setup["predicted"][name] - split) / split
    if "executor_megatron_bb_split" in m:
        split, ratios = m["executor_megatron_bb_split"], out["ratios"]
        if "optimus_bb_split" in m:
            ratios["optimus_bb_split_vs_executor_megatron_bb_split"] = split / m["optimus_bb_split"]
        ratios["executor_megatron_bb_split_vs_executor_megatron"] = m["executor_megatron"] / split
        predicted = setup["predicted"]["executor_megatron_bb_split"]
        ratios["predicted_error_executor_megatron_bb_split"] = (predicted - split) / split
    for name in (n for n in RECV_ABLATED if f"{n}_recv_needed" in m):
        out["ratios"][f"{name}_recv_ahead_gain"] = m[f"{name}_recv_needed"] / m[name]
    out["optimus_spans"] = [sp for o in outs["optimus"] for sp in o["spans"]]
    return out


def _fields(b: dict) -> dict:
    """A StepBreakdown's constructor fields from its as_dict()."""
    return {k: v for k, v in b.items() if k != "overhead_per_action_s"}


def summarise(setup: dict, repeats: list[dict], memory: dict, args) -> dict:
    """Medians over repeats (and min-max) of every step time and ratio; the breakdown from the
    last repeat, per run and rank."""
    names = list(setup["jobs"])

    from bench_common import over_repeats as over

    predicted = dict(setup["predicted"])
    predicted["optimus_replanned"] = statistics.median(r["replan_predicted_s"] for r in repeats)
    predicted["optimus_candidates"] = statistics.median(
        next(c["predicted_s"] for c in r["candidates"] if c["kept"]) for r in repeats
    )
    result: dict = {}
    for name in names:
        med, lo, hi = over([r["measured_s"][name] for r in repeats])
        result[f"{name}_s"] = med
        result[f"{name}_s_range"] = (lo, hi)
    result["limit_s"] = statistics.median(r["limit_s"] for r in repeats)
    for key in [k for k in (*RATIOS, *SPLIT_RATIOS) if k in repeats[0]["ratios"]]:
        med, lo, hi = over([r["ratios"][key] for r in repeats])
        result[key], result[f"{key}_min"], result[f"{key}_max"] = med, lo, hi
    result["max_abs_loss_diff"] = max(  # step 0's: the same weights and data for every run
        abs(r["losses"][a][k] - r["losses"]["megatron_core_1f1b"][k])
        for r in repeats
        for a in names
        for k in r["losses"]["megatron_core_1f1b"]
    )
    result["candidates"] = [r["candidates"] for r in repeats]
    result["candidate_build_s"] = statistics.median(r["candidate_build_s"] for r in repeats)
    result["calibration"] = [r["calibration"] for r in repeats]
    result["phase_steps"] = [r["phase_steps"] for r in repeats]
    result["kept_candidate"] = [
        next(c["label"] for c in r["candidates"] if c["kept"]) for r in repeats
    ]
    result["candidate_second_look"] = [  # the close call looked at again, per repeat
        [r["candidates"][i]["label"] for i in r["second_look"] or ()] for r in repeats
    ]
    n = setup["n"]
    breakdown = {}
    for name in names:
        breakdown[name] = []
        for rank in repeats[-1]["breakdown"][name]:
            rank = dict(rank)
            rank["overhead_per_microbatch_s"] = rank["overhead_s"] / n
            breakdown[name].append(rank)
    best = setup["best"]
    result.update(
        breakdown=breakdown,
        dp_unhidden_share={k: statistics.median(r["dp_share"][k] for r in repeats) for k in names},
        memory=memory,
        precision=args.precision,
        size=args.size,
        repeats=args.repeats,
        predicted_s=predicted,
        step_range_s={k: repeats[-1]["spread"][k] for k in names},
        encoder_plan=str(best.options.encoder_plan),
        encoder_placement=best.options.placement,
        balanced_first_stage_layers=setup["balanced"][0].meta.backbone_layers[0],
        microbatches=n,
        measured_steps=args.steps,
        dp_gbps=setup["dp_gbps"],
    )
    return result


def write_trace(path: str, real: list, best) -> None:
    """The Optimus run's measured spans and the simulator's prediction as one Chrome trace."""
    from megatron_mllm.schedule.simulator import simulate
    from megatron_mllm.schedule.trace import chrome_trace_events

    sim = simulate(best.schedule, best.workload, keep_spans=True)
    events = chrome_trace_events(real, "measured")
    for e in chrome_trace_events(sim.spans, "predicted"):
        e["pid"] = e.get("pid", 0) + 100
        events.append(e)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def print_report(result: dict, setup: dict, args) -> None:
    cfg, n, names = setup["cfg"], setup["n"], list(setup["jobs"])
    base = result["megatron_core_1f1b_s"]
    print(
        f"{args.size} MLLM (ViT {cfg.vit_layers}x{cfg.vit_hidden}, GPT {cfg.llm_layers}x"
        f"{cfg.llm_hidden}), PP=2 on 2 ranks x 1 thread, {n} micro-batches, {args.repeats} "
        f"repeats of {args.steps} steps; Optimus plan: encoder {result['encoder_plan']} "
        f"({result['encoder_placement']})"
    )
    print(
        f"{'run':<20}{'step s':>9}{'min-max over repeats':>22}{'vs mcore':>10}"
        f"{'predicted s':>13}{'pred. err':>10}"
    )
    for name in names:
        s, p = result[f"{name}_s"], result["predicted_s"][name]
        lo, hi = result[f"{name}_s_range"]
        print(
            f"{name:<20}{s:>9.3f}{lo:>13.3f}-{hi:<8.3f}{base / s:>9.2f}x{p:>13.3f}"
            f"{100 * (p - s) / s:>9.1f}%"
        )
    print(
        f"{'zero-bubble limit':<20}{result['limit_s']:>9.3f}{'':>22}"
        f"{base / result['limit_s']:>9.2f}x"
    )
    print("where the time goes (last repeat, per step, ms; overhead per action / per micro-batch):")
    print(
        f"{'run r':<22}{'step':>8}{'compute':>9}{'wait':>8}{'comm':>8}{'fill':>8}{'overhd':>8}"
        f"{'/action':>9}{'/mb':>8}"
    )
    for name in names:
        for r, b in enumerate(result["breakdown"][name]):
            print(
                f"{name + ' r' + str(r):<22}"
                + "".join(
                    f"{1e3 * b[k]:>{w}.1f}"
                    for k, w in (
                        ("seconds", 8),
                        ("compute_s", 9),
                        ("wait_s", 8),
                        ("comm_unhidden_s", 8),
                        ("fill_s", 8),
                        ("overhead_s", 8),
                    )
                )
                + f"{1e3 * b['overhead_per_action_s']:>9.3f}"
                + f"{1e3 * b['overhead_per_microbatch_s']:>8.2f}"
            )
    print(
        f"{'memory per rank (MB)':<28}{'params':>8}{'grads':>8}{'optim':>8}{'acts':>8}"
        f"{'total':>8}{'planned':>9}{'ratio':>7}"
    )
    for name, ranks in result["memory"].items():
        for r, m in enumerate(ranks):
            print(
                f"{name + ' r' + str(r):<28}"
                + "".join(f"{m[k] / 1e6:>8.2f}" for k in ("params", "grads", "optimizer"))
                + f"{m['activations'] / 1e6:>8.2f}{m['total'] / 1e6:>8.2f}"
                f"{m['planned_total'] / 1e6:>9.2f}{m['total'] / m['planned_total']:>7.2f}"
            )
    from megatron_mllm.training.candidate_run import table

    for r, rows in enumerate(result["candidates"]):
        print(f"repeat {r}:")
        print(table(rows, result["candidate_build_s"], 0, 0).split("\n", 1)[1])
    print("like for like, medians over repeats (min-max):")
    for key in [k for k in (*RATIOS, *SPLIT_RATIOS) if k in result]:
        print(
            f"  {key:<32}{result[key]:>7.3f}  ({result[key + '_min']:.3f}-"
            f"{result[key + '_max']:.3f})"
        )
    print(f"  max |loss diff| {result['max_abs_loss_diff']:.2e}")


def measure_memory(jobs: dict, plan, planned: dict) -> dict:
    """One more step of each run with memory measured (saved-tensor hooks slow a step, so not
    in the timed ones), next to the planner's estimate for its schedule: per rank, bytes."""
    from dataclasses import replace

    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.assembly.memory import planned_memory
    from megatron_mllm.runtime.job import Collect
    from megatron_mllm.runtime.modes.runs import run_interleaved

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

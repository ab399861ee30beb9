"""`tools/plan_schedule.py`: plan megatron / balanced / optimus for one job and compare them."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

from megatron_mllm.cli.presets import PRESETS, apply_preset, native_steps
from megatron_mllm.errors import ConfigError, OneLineParser, exit_on_config_error
from megatron_mllm.parallel.plans import ParallelPlan, colocated_encoder_plan
from megatron_mllm.schedule.adaptive import AdaptivePlanner, timed_step
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.config import MLLMJob
from megatron_mllm.schedule.cost_model import load_measured_times
from megatron_mllm.schedule.hardware import get_profile
from megatron_mllm.schedule.loads import (
    balanced_assignment,
    draw_samples,
    load_samples,
    loader_assignment,
    mean_images,
    parse_distribution,
)
from megatron_mllm.schedule.lookahead import SHIFTS, lookahead_merge
from megatron_mllm.schedule.planner import PlanReport, plan_all
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import BUBBLE_CAUSES, simulate
from megatron_mllm.schedule.specs import load_model
from megatron_mllm.schedule.validator import validate


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a whole job by name (cli/presets.py says what it sets and why); any flag given "
        "overrides its setting",
    )
    p.add_argument(
        "--encoder",
        action="append",
        default=None,
        help="encoder model name or YAML (repeat for several encoders)",
    )
    p.add_argument("--backbone", default=None, help="backbone model name or YAML")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--tp", type=int, default=None, help="backbone tensor-parallel size (1)")
    p.add_argument("--pp", type=int, default=None, help="backbone pipeline-parallel size (1)")
    p.add_argument("--vpp", type=int, default=1, help="backbone virtual pipeline size")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None, help="(1)")
    p.add_argument("--seq-len", type=int, default=None, help="backbone sequence length")
    p.add_argument(
        "--encoder-seq-len",
        type=int,
        default=None,
        help="tokens per sample in the encoder (default: --seq-len)",
    )
    p.add_argument("--gpu", default="h100", help="hardware profile: h100 or a100")
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="override the profile's achievable fraction of peak",
    )
    p.add_argument(
        "--frozen-encoder",
        action="store_true",
        help="encoders run forward only (the projector still trains)",
    )
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--encoder-tp", type=int, default=None, help="force the encoder TP size")
    p.add_argument("--encoder-pp", type=int, default=None, help="force the encoder PP size")
    p.add_argument(
        "--measured-times",
        default=None,
        help="JSON of measured seconds replacing the analytic ones: {model: {forward|backward: "
        "{kernel: s}, collectives: {all_reduce|all_gather|reduce_scatter[_b]: s}}}",
    )
    p.add_argument("--trace", default=None, help="write the Optimus Chrome trace JSON here")
    p.add_argument("--png", default=None, help="write a PNG timeline of all three schedules")
    p.add_argument("--save-schedule", default=None, help="write the Optimus schedule as CSV")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--images-per-sample",
        default=None,
        metavar="DIST",
        help="images per sample as IMAGES:SHARE,... (e.g. 0:0.1,1:0.6,2:0.2,4:0.1): plan for "
        "the mean, time every schedule on --sample-steps drawn global batches, and plan "
        "optimus-adaptive for each",
    )
    p.add_argument(
        "--encoder-loads",
        default=None,
        metavar="FILE",
        help='instead of drawing: JSON {"global_batch": G, "steps": [[images per sample, ...], '
        "...]}",
    )
    p.add_argument(
        "--encoder-wgrad-split",
        action="store_true",
        help="also try the best Optimus plan with the encoder's backward split into input- and "
        "weight-gradient work (EB / EW; simulation only), kept where faster",
    )
    p.add_argument(
        "--backbone-wgrad-split",
        action="store_true",
        help="also try the best Optimus plan with the backbone's backward split where a "
        "pipeline peer waits for it (B / W; simulation only), kept where faster",
    )
    p.add_argument(
        "--coreset-pool-ratio",
        type=float,
        default=None,
        metavar="R",
        help="also predict the coreset's look-ahead: the next step's pool of R x the global "
        "batch going forward in the Optimus step's bubbles, against its own pass then the step",
    )
    p.add_argument(
        "--coreset-lookahead-order",
        choices=list(SHIFTS),
        default="simulated",
        help="the look-ahead's order, as pretrain_mllm.py's option of the same name",
    )
    p.add_argument(
        "--image-pixels",
        default=None,
        metavar="DIST",
        help="with a native-resolution preset: each image's pixels as PIXELS:SHARE,... "
        "(squares, e.g. 50176:0.5,802816:0.5 for 224 and 896 px); each sample's load is its "
        "images' cost at their sizes in nominal images, its image count from "
        "--images-per-sample",
    )
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="for drawing the loads")
    return p


def job_from_args(args: argparse.Namespace) -> tuple[MLLMJob, dict | None]:
    hw = get_profile(args.gpu)
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise ConfigError(f"--efficiency {args.efficiency} must be in (0, 1]")
        hw = hw.with_efficiency(args.efficiency)
    encoders = tuple(load_model(e, encoder=True) for e in args.encoder)
    backbone = load_model(args.backbone, encoder=False)
    job = MLLMJob(
        encoders,
        backbone,
        args.gpus,
        args.tp,
        args.pp,
        args.global_batch,
        args.micro_batch,
        args.seq_len,
        hw,
        vpp=args.vpp,
        frozen_encoders=args.frozen_encoder,
        sequence_parallel=not args.no_sequence_parallel,
        encoder_seq_len=args.encoder_seq_len,
    )
    measured = None
    if args.measured_times:
        measured = load_measured_times(
            args.measured_times, [e.name for e in encoders] + [backbone.name]
        )
    return job, measured


def lookahead_prediction(args, job: MLLMJob, measured, report: PlanReport) -> dict | None:
    """The Optimus step with the next coreset pool's forward merged in (`lookahead_merge`):
    predicted seconds, against the pool's pass alone and then the step (None without
    --coreset-pool-ratio)."""
    if args.coreset_pool_ratio is None:
        return None
    from megatron_mllm.schedule.bubble_scheduler import optimus_schedule

    ratio = args.coreset_pool_ratio
    pool_batch = pool_global_batch(ratio, job)
    planned = report.optimus
    layers = tuple(planned.schedule.meta.backbone_layers)
    pool_job = replace(job, global_batch=pool_batch, backbone_split=layers)
    options = replace(planned.options, wgrad_split=False, backbone_wgrad_split=False)
    pool, pool_workload = optimus_schedule(JobCosts(pool_job, measured), options)
    order = args.coreset_lookahead_order
    times = lookahead_merge(planned.schedule, pool, planned.workload, order).lookahead_times
    out = {
        "order": args.coreset_lookahead_order,
        "lookahead_step_s": times.step_s,
        "step_alone_s": times.step_alone_s,
        "pool_alone_s": times.pool_alone_s,
    }
    # The pool's schedule trained whole is R x B by accumulation (B's activation memory).
    out["accumulation_s"] = simulate(pool, pool_workload, keep_spans=False).step_time_s
    return out


def pool_global_batch(ratio: float, job: MLLMJob) -> int:
    """The coreset pool's size over all replicas, or ConfigError naming what would do."""
    from megatron_mllm.data.coreset import MAX_POOL_RATIO

    whole = job.micro_batch * job.plan.dp
    if not 1 <= ratio <= MAX_POOL_RATIO or round(ratio * job.global_batch) % whole:
        raise ConfigError(
            f"--coreset-pool-ratio {ratio}: give 1 to {MAX_POOL_RATIO:g} making a pool of whole "
            f"micro-batches per replica ({job.micro_batch} x DP {job.plan.dp})"
        )
    return round(ratio * job.global_batch)


def format_lookahead(pred: dict, ratio: float) -> str:
    alone = pred["step_alone_s"] + pred["pool_alone_s"]
    return (
        f"coreset look-ahead (pool {ratio:g} x B): pool pass {pred['pool_alone_s']:.3f} s then "
        f"the step {pred['step_alone_s']:.3f} s = {alone:.3f} s; the next pool in the step's "
        f"bubbles {pred['lookahead_step_s']:.3f} s ({alone / pred['lookahead_step_s']:.3f}x); "
        f"{ratio:g} x B by accumulation {pred['accumulation_s']:.3f} s (selection's own compute "
        "not included)"
    )


def forced_encoder_plan(args: argparse.Namespace, job: MLLMJob) -> ParallelPlan | None:
    if args.encoder_tp is None and args.encoder_pp is None:
        return None
    plan = colocated_encoder_plan(job.plan, args.encoder_tp or 1, args.encoder_pp or 1)
    min_layers = min(e.num_layers for e in job.encoders)
    if plan.pp > min_layers:
        raise ConfigError(
            f"encoder PP {plan.pp} is more stages than the encoder's {min_layers} "
            f"layers; use at most {min_layers}"
        )
    return plan


def report_dict(report: PlanReport) -> dict:
    base = report.megatron.result.step_time_s
    out = {}
    for name, planned in report.schedules.items():
        r = planned.result
        entry = {
            "step_time_s": r.step_time_s,
            "speedup_vs_megatron": base / r.step_time_s,
            "bubble_ratio": r.bubble_ratio,
            "bubbles_s": r.bubbles_s,
            "bubbles_by_rank_s": r.bubbles_by_rank_s,
            "peak_memory_gb": r.peak_memory_gb,
        }
        if planned.options is not None:
            p = planned.options.encoder_plan
            entry["encoder_plan"] = {"dp": p.dp, "tp": p.tp, "pp": p.pp}
            entry["microbatch_split"] = planned.options.split
            entry["extra_warmup"] = planned.options.extra_warmup
            entry["wgrad_split"] = planned.options.wgrad_split
            entry["backbone_wgrad_split"] = planned.options.backbone_wgrad_split
        out[name] = entry
    return {
        "schedules": out,
        "limit_step_time_s": report.optimus.result.limit_s,
        "backbone_alone_step_s": report.backbone_alone_s,
        "planner_seconds": report.planner_seconds,
        "candidates": len(report.candidates),
    }


def format_table(report: PlanReport, memory_gb: float) -> str:
    base = report.megatron.result.step_time_s
    head = (
        f"{'schedule':<10}{'step s':>9}{'speedup':>9}{'bubbles':>9}"
        + "".join(f"{c:>12}" for c in BUBBLE_CAUSES)
        + f"{'peak GB':>9}  plan"
    )
    lines = [head, "-" * len(head)]
    for name, planned in report.schedules.items():
        r = planned.result
        plan = str(planned.options.encoder_plan) if planned.options else ""
        if planned.options:
            plan = f"encoder {plan}, split {planned.options.split}"
        over = "!" if r.peak_memory_gb > memory_gb else " "
        lines.append(
            f"{name:<10}{r.step_time_s:>9.3f}{base / r.step_time_s:>8.2f}x{r.bubble_ratio:>9.1%}"
            + "".join(f"{r.bubbles_s[c]:>12.3f}" for c in BUBBLE_CAUSES)
            + f"{r.peak_memory_gb:>8.1f}{over}  {plan}"
        )
    alone = report.backbone_alone_s
    lines.append(
        f"backbone alone {alone:.3f} s (no encoder work: no schedule keeping this backbone is "
        f"faster, at most {base / alone:.2f}x Megatron)"
    )
    lines.append(
        f"zero-bubble limit {report.optimus.result.limit_s:.3f} s; bubble columns are "
        f"idle seconds per GPU; '!' marks a peak over {memory_gb:.0f} GB; planner "
        f"{report.planner_seconds:.1f} s CPU over {len(report.candidates)} candidate(s)"
    )
    return "\n".join(lines)


def drawn_steps(
    args: argparse.Namespace, job: MLLMJob, preset=None
) -> tuple[list[list[float]] | None, float]:
    """Each step's encoder load per sample (loader order): image counts drawn or read, or a
    native tower's nominal images by patches (`--image-pixels`); None for neither; and the
    mean the schedules are planned for."""
    if args.images_per_sample is not None and args.encoder_loads is not None:
        raise ConfigError("give --images-per-sample or --encoder-loads, not both")
    if args.image_pixels is not None:
        return native_steps(args, preset, job.global_batch)
    if args.encoder_loads is not None:
        steps = load_samples(args.encoder_loads, job.global_batch)
        return steps, statistics.fmean(x for s in steps for x in s)
    if args.images_per_sample is None:
        return None, 1.0
    dist = parse_distribution(args.images_per_sample)
    steps = draw_samples(dist, args.sample_steps, job.global_batch, args.seed)
    return steps, mean_images(dist)


def sampled_times(
    report: PlanReport, steps: list[list[int]], adaptive: AdaptivePlanner
) -> dict[str, list[float]]:
    """name -> every step's simulated time on the replica with the most images: the three
    schedules (planned for the mean) on the loader's assignment and on the balanced one (the
    assignment alone, which any schedule can use), and optimus-adaptive's per-step plans."""
    job, costed = adaptive.costs.job, adaptive.costed
    loader = loader_assignment(job.global_batch, job.plan.dp, job.micro_batch)
    out: dict[str, list[float]] = {}
    for counts in steps:
        balanced = balanced_assignment(counts, job.plan.dp, job.micro_batch)
        for name, planned in report.schedules.items():
            for suffix, assignment in (("", loader), ("_balanced_assignment", balanced)):
                _, sim = timed_step(planned.schedule, planned.workload, counts, assignment, costed)
                out.setdefault(name + suffix, []).append(sim.step_time_s)
        out.setdefault("optimus_adaptive", []).append(adaptive.plan(counts).step_time_s)
    return out


def sampled_dict(times: dict) -> dict:
    base = statistics.mean(times["megatron"])
    return {
        name: {
            "step_time_s": statistics.mean(ts),
            "step_time_min_s": min(ts),
            "step_time_max_s": max(ts),
            "speedup_vs_megatron": base / statistics.mean(ts),
        }
        for name, ts in times.items()
    }


def format_sampled(times: dict, mean: float, adaptive: AdaptivePlanner) -> str:
    rows = sampled_dict(times)
    static = rows["optimus"]["step_time_s"]
    lines = [
        f"on {len(times['megatron'])} steps ({mean:.2f} images per sample on average; "
        "timed on the replica with the most images):",
        f"{'schedule':<28}{'mean s':>9}{'min-max s':>18}{'speedup':>9}{'vs optimus':>12}",
    ]
    for name, r in rows.items():
        span = f"{r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f}"
        lines.append(
            f"{name:<28}{r['step_time_s']:>9.3f}{span:>18}{r['speedup_vs_megatron']:>8.2f}x"
            f"{static / r['step_time_s']:>11.2f}x"
        )
    secs = adaptive.seconds
    lines.append(
        f"per-step planning: {statistics.mean(secs):.3f} s CPU a step (max {max(secs):.3f}), "
        f"{adaptive.hits} cache hit(s) of {len(secs)}"
    )
    return "\n".join(lines)


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    preset = apply_preset(args)
    job, measured = job_from_args(args)
    if args.coreset_pool_ratio is not None:
        pool_global_batch(args.coreset_pool_ratio, job)  # bad input before any planning
    steps, mean = drawn_steps(args, job, preset)
    if steps is not None:
        job = replace(job, images_per_sample=mean)
    costs = JobCosts(job, measured)
    splits = (args.encoder_wgrad_split, args.backbone_wgrad_split)
    report = plan_all(costs, forced_encoder_plan(args, job), *splits)
    if args.save_schedule:
        report.optimus.schedule.to_csv(args.save_schedule)
    if args.trace or args.png:
        from megatron_mllm.schedule.trace import write_chrome_trace, write_png

        full = {
            name: simulate(p.schedule, p.workload, keep_spans=True)
            for name, p in report.schedules.items()
        }
        if args.trace:
            write_chrome_trace(full["optimus"], args.trace, "optimus")
        if args.png:
            write_png(full, args.png)
    ahead = lookahead_prediction(args, job, measured, report)
    times = adaptive = None
    if steps is not None:
        adaptive = AdaptivePlanner(costs, report.optimus, mean)
        times = sampled_times(report, steps, adaptive)
    if args.json:
        out = report_dict(report)
        if times is not None:  # each schedule timed on the drawn loads, step_time_s the mean
            for name, sampled in sampled_dict(times).items():
                out["schedules"].setdefault(name, {}).update(sampled)
            out["images_per_sample"] = mean
            out["sample_steps"] = len(steps)
            out["replan_seconds_per_step"] = statistics.mean(adaptive.seconds)
            out["replan_seconds_max"] = max(adaptive.seconds)
            out["replan_cache_hits"] = adaptive.hits
        if ahead is not None:
            out["coreset_lookahead"] = ahead
        print(json.dumps(out))
    else:
        print(format_table(report, job.hw.memory_gb))
        if times is not None:
            print(format_sampled(times, mean, adaptive))
        if ahead is not None:
            print(format_lookahead(ahead, args.coreset_pool_ratio))
    return 0


@exit_on_config_error
def check_schedule_main(argv: list[str] | None = None) -> int:
    """`tools/check_schedule.py FILE.csv`: load and validate a schedule CSV."""
    p = OneLineParser(description="Validate a schedule CSV written by --save-schedule.")
    p.add_argument("csv")
    args = p.parse_args(argv)
    schedule = Schedule.from_csv(args.csv)
    validate(schedule)
    counts = [len(a) for a in schedule.ranks]
    print(
        f"valid: {schedule.meta.pp} ranks, {schedule.meta.num_microbatches} micro-batches, "
        f"{len(schedule.meta.encoders)} encoder(s), {sum(counts)} actions"
    )
    return 0

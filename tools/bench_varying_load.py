"""Varying-load benchmark (tools/bench_runtime.py --data-path DIR --tokenizer-model DIR, or
--images-per-sample DIST for LLaVA digits drawn from DIST): real steps on 2 ranks x 1 thread,
PP=2, on LLaVA-format conversations whose micro-batches hold different numbers of images
(text-only ones included), four runs interleaved step by step in one 2-process gloo job from
the same weights and data:

  megatron_core_1f1b  megatron-core's own 1F1B, encoder on stage 0, even split (its gradient
                      reduction at step end: its overlapped one refuses text-only micro-batches)
  balanced            our executor on the Megatron schedule with the balancing layer split
  optimus             our executor, Optimus planned once for the data set's mean load
  optimus_adaptive    the same plan, each step re-planned for its own images one step ahead

With --calculate-per-token-loss every run uses Megatron's per-token loss, optimus_adaptive
also deals each step's samples into micro-batches of equal image counts (the step's gradient
is unchanged by it), and a fifth run, optimus_balanced, deals them so under the static plan
(what the dealing alone buys).

Step times are the slowest rank's per step; medians and min-max over the measured steps (the
first step warms up). Per-step planning time and fallbacks come from optimus_adaptive's run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace


def varying_load(args) -> int:
    """The benchmark on `args.data_path`, or on data drawn from `args.images_per_sample` (made
    in a temporary folder and removed after)."""
    if args.images_per_sample is None:
        return _varying_load(args, max_images=2)  # the demo's digits: 0-2 images a sample
    import tempfile

    from megatron_mllm.schedule.loads import parse_distribution

    dist = parse_distribution(args.images_per_sample)  # bad input before any file is written
    with tempfile.TemporaryDirectory(prefix="bench_varying_load_") as tmp:
        args.data_path, args.tokenizer_model = drawn_data(tmp, dist, args.records)
        return _varying_load(args, max_images=max(dist))


def drawn_data(folder: str, dist: dict[int, float], records: int) -> tuple[str, str]:
    """A LLaVA digits data set whose image counts are drawn from `dist`, as energon shards in
    `folder`: (its path, its tokenizer's)."""
    from pathlib import Path

    from megatron_mllm.data.energon_llava import convert_llava
    from megatron_mllm.data.llava_digits import conversation_texts, write_llava_digits
    from megatron_mllm.data.tokenizer import train_tiny_tokenizer

    raw, out = Path(folder) / "llava", Path(folder) / "energon"
    path = write_llava_digits(raw, records, 0, dist)
    train_tiny_tokenizer(conversation_texts(path), raw / "tokenizer", 384)
    convert_llava(path, raw / "images", out, progress=False)
    return str(out), str(raw / "tokenizer")


def _varying_load(args, max_images: int) -> int:
    import torch

    from megatron_mllm.data.energon_llava import images_per_sample
    from megatron_mllm.data.llava_source import LlavaData
    from megatron_mllm.data.tokenizer import load_tokenizer
    from megatron_mllm.models.config import BENCH
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import ExecutorSettings, PlanParts
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.modes.runs import run_interleaved
    from megatron_mllm.runtime.planning.profile_units import profile_units
    from megatron_mllm.schedule.baselines import megatron_schedule
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.schedule.planner import plan_optimus

    if args.tokenizer_model is None:
        raise SystemExit("error: --data-path needs --tokenizer-model DIR (its tokenizer)")
    vocab = -(-len(load_tokenizer(args.tokenizer_model)) // 128) * 128
    # The most images a sample has, 64 tokens each, and its conversation (128 positions).
    seq = max_images * BENCH.image_tokens + 128
    cfg = replace(BENCH, vocab_size=vocab, text_len=seq - BENCH.image_tokens)
    plan, n, mb = ParallelPlan(1, 1, 2), args.microbatches, max(args.micro_batch, 2)
    load = images_per_sample(args.data_path)
    data = LlavaData(args.data_path, args.tokenizer_model, cfg.seq_len, num_workers=1)
    state = spawn(make_full_state, 1, cfg, 0)[0]
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    measured = spawn(profile_units, plan.world_size, cfg, mb, 5, dtype)[0]
    from bench_common import bench_run

    per_token = args.calculate_per_token_loss
    run = bench_run(cfg, args, plan, n, mb, *(["--calculate-per-token-loss"] * per_token))
    costs = JobCosts(replace(run.planning_job(), images_per_sample=load), measured, unit="layer")
    balanced = megatron_schedule(costs)
    best, _, _ = plan_optimus(costs)
    bf16 = args.precision == "bf16"
    steps = args.steps + 1
    base = replace(run.runtime_job(None, state), steps=steps)
    base = replace(base, data=replace(base.data, llava=data))

    def job(parts, mode="executor", executor=None, balance=False):
        # megatron-core's overlapped reduction needs every step's last micro-batch to reach
        # the encoder, which a text-only one does not: its run reduces at step end.
        overlap = mode == "executor"
        knobs = dict(overlap_grad_reduce=overlap, overlap_param_gather=overlap and bf16)
        return replace(
            base,
            plans=parts,
            data=replace(base.data, balance_samples=balance),
            mode=mode,
            executor=executor or ExecutorSettings(),
            optimizer=replace(base.optimizer, **knobs),
        )

    adaptive = ExecutorSettings(adaptive=True, images_per_sample=load, plan_times=measured)
    jobs = {
        "megatron_core_1f1b": job(PlanParts(plan), "megatron_core"),
        "balanced": job(PlanParts(plan, schedule=balanced[0])),
        "optimus": job(PlanParts(plan, schedule=best.schedule)),
        "optimus_adaptive": job(
            PlanParts(plan, schedule=best.schedule), executor=adaptive, balance=per_token
        ),
    }
    if per_token:
        jobs["optimus_balanced"] = job(PlanParts(plan, schedule=best.schedule), balance=True)
    per_rank = spawn(run_interleaved, plan.world_size, list(jobs.values()), steps)
    from megatron_mllm.runtime.planning.schedules import adaptive_planner

    planner = adaptive_planner(jobs["optimus_adaptive"])
    result = {"microbatches": n, "micro_batch": mb, "measured_steps": args.steps}
    result["seq_length"] = cfg.seq_len
    result["images_per_sample"] = load
    result["per_token_loss"] = per_token
    result["encoder_plan"] = str(best.options.encoder_plan)
    times, losses = {}, {}
    for i, name in enumerate(jobs):
        out = [rank_results[i] for rank_results in per_rank]
        per_step = [max(o["seconds"][s] for o in out) for s in range(1, steps)]
        times[name] = per_step
        losses[name] = [
            {k: v for o in out for k, v in o["history"][s].items()} for s in range(steps)
        ]
        if per_token:  # samples change micro-batches: the step's per-token mean is compared
            losses[name] = [{"step": v} for v in out[0]["mean_losses"]]
        result[f"{name}_s"] = statistics.median(per_step)
        result[f"{name}_range_s"] = (min(per_step), max(per_step))
        if name == "optimus_adaptive":
            stats = out[0]["step_plans"]
            result["planned_steps"], result["fallbacks"] = stats.planned, stats.fallbacks
            orders = out[0]["step_orders"]
            result["reordered_steps"] = sum(o is not None and o != sorted(o) for o in orders)
            secs = out[0]["step_plan_seconds"]
            result["plan_seconds_mean"] = statistics.mean(secs) if secs else 0.0
            result["plan_seconds_max"] = max(secs) if secs else 0.0
    # Paired per step: the same data in the same step for both.
    ratios = [a / b for a, b in zip(times["optimus"], times["optimus_adaptive"], strict=True)]
    result["adaptive_vs_static"] = statistics.median(ratios)
    result["adaptive_vs_static_range"] = (min(ratios), max(ratios))
    if planner is not None:
        result.update(predicted(planner, jobs, range(1, steps), n, per_token))
    if per_token:
        ratios = [a / b for a, b in zip(times["optimus"], times["optimus_balanced"], strict=True)]
        result["balanced_samples_vs_static"] = statistics.median(ratios)
        result["balanced_samples_vs_static_range"] = (min(ratios), max(ratios))
    result["adaptive_vs_megatron_core"] = (
        result["megatron_core_1f1b_s"] / result["optimus_adaptive_s"]
    )
    result["max_abs_loss_diff_adaptive_vs_static"] = max(
        abs(a[k] - b[k])
        for a, b in zip(losses["optimus"], losses["optimus_adaptive"], strict=True)
        for k in a
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"BENCH MLLM on {args.images_per_sample or args.data_path} ({load:.2f} images per "
        f"sample on average), sequence {cfg.seq_len}, PP=2 on 2 ranks x 1 thread, {n} "
        f"micro-batches of {mb}; Optimus encoder {result['encoder_plan']}"
    )
    print(f"{'run':<20}{'step s':>9}{'min-max':>16}{'vs mcore':>10}")
    base = result["megatron_core_1f1b_s"]
    for name in jobs:
        (lo, hi), step = result[f"{name}_range_s"], result[f"{name}_s"]
        print(f"{name:<20}{step:>9.3f}{lo:>8.3f}-{hi:<7.3f}{base / step:>9.2f}x")
    lo, hi = result["adaptive_vs_static_range"]
    print(
        f"optimus_adaptive vs optimus, paired per step: {result['adaptive_vs_static']:.3f}x "
        f"(min-max {lo:.3f}-{hi:.3f}); {result['planned_steps']} steps planned "
        f"({result['reordered_steps']} with micro-batches in other slots), "
        f"{result['fallbacks']} fallback(s), planning {1000 * result['plan_seconds_mean']:.1f} ms "
        f"CPU a step (max {1000 * result['plan_seconds_max']:.1f}); max |loss diff| "
        f"{result['max_abs_loss_diff_adaptive_vs_static']:.2e}"
        + (" (the steps' per-token means)" if per_token else "")
    )
    if "predicted_adaptive_vs_static" in result:
        print(
            "simulator on the measured steps' loads (unit times profiled in this run): "
            f"adaptive vs static {result['predicted_adaptive_vs_static']:.3f}x"
            + (
                f", dealing alone {result['predicted_balanced_samples_vs_static']:.3f}x"
                if per_token
                else ""
            )
        )
    if per_token:
        lo, hi = result["balanced_samples_vs_static_range"]
        print(
            f"optimus_balanced vs optimus, paired per step: "
            f"{result['balanced_samples_vs_static']:.3f}x (min-max {lo:.3f}-{hi:.3f})"
        )
    return 0


def predicted(planner, jobs: dict, steps, n: int, per_token: bool) -> dict:
    """The simulator's step-time ratios on the measured steps' real micro-batch loads (medians
    over the steps): static Optimus on the loader's micro-batches against the per-step plan
    (on the dealt ones with a per-token loss) and, with a per-token loss, against the static
    plan on the dealt ones."""
    from megatron_mllm.runtime.inputs.batches import StepData
    from megatron_mllm.schedule.adaptive import timed_step
    from megatron_mllm.schedule.loads import loader_assignment

    static, one = planner.static, loader_assignment(n, 1, 1)

    def static_s(counts: list[int]) -> float:
        return timed_step(static.schedule, static.workload, counts, one, planner.costed)[
            1
        ].step_time_s

    readers = {"loader": StepData(jobs["optimus"], [0])}
    if per_token:
        readers["dealt"] = StepData(jobs["optimus_adaptive"], [0])
    counts = {k: [] for k in readers}
    for step in range(max(steps) + 1):
        for k, reader in readers.items():
            get = reader.step(step)
            counts[k].append([get(m).num_images for m in range(n)])
    for reader in readers.values():
        reader.close()
    mine = counts["dealt" if per_token else "loader"]
    out = {
        "predicted_adaptive_vs_static": statistics.median(
            static_s(counts["loader"][s]) / planner.plan(mine[s]).step_time_s for s in steps
        )
    }
    if per_token:
        out["predicted_balanced_samples_vs_static"] = statistics.median(
            static_s(counts["loader"][s]) / static_s(mine[s]) for s in steps
        )
    return out

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
from operator import truediv

# --native-resolution: images per conversation, and each image's side in pixels (patches of 4:
# 16 to 576 an image, 36x), conversations packed into rows of NATIVE_SEQ tokens.
NATIVE_IMAGES = "0:0.2,1:0.5,2:0.3"
NATIVE_SIDES = "16:0.35,32:0.3,64:0.2,96:0.15"
NATIVE_SEQ = 384
NATIVE_PIXELS = dict(min_pixels=64, max_pixels=96 * 96)  # the images' bounds, as drawn


def varying_load(args) -> int:
    """The benchmark on `args.data_path`, or on data drawn from `args.images_per_sample` (made
    in a temporary folder and removed after); with `args.native_resolution` on digits of drawn
    sizes for a native tower, packed."""
    if args.images_per_sample is None and not args.native_resolution:
        return _varying_load(args, max_images=2)  # the demo's digits: 0-2 images a sample
    import tempfile

    from megatron_mllm.schedule.loads import parse_distribution

    native = args.native_resolution
    dist = parse_distribution(args.images_per_sample or NATIVE_IMAGES)  # bad input first
    sides = parse_distribution(NATIVE_SIDES, "--image-sizes") if native else None
    with tempfile.TemporaryDirectory(prefix="bench_varying_load_") as tmp:
        args.data_path, args.tokenizer_model = drawn_data(tmp, dist, args.records, sides)
        return _varying_load(args, max_images=max(dist))


def drawn_data(
    folder: str, dist: dict[int, float], records: int, sides: dict[int, float] | None = None
) -> tuple[str, str]:
    """A LLaVA digits data set whose image counts are drawn from `dist` (and image sides from
    `sides`), as energon shards in `folder`: (its path, its tokenizer's)."""
    from pathlib import Path

    from megatron_mllm.data.energon_llava import convert_llava
    from megatron_mllm.data.llava_digits import conversation_texts, write_llava_digits
    from megatron_mllm.data.tokenizer import train_tiny_tokenizer

    raw, out = Path(folder) / "llava", Path(folder) / "energon"
    path = write_llava_digits(raw, records, 0, dist, sides)
    train_tiny_tokenizer(conversation_texts(path), raw / "tokenizer", 384)
    convert_llava(path, raw / "images", out, progress=False)
    return str(out), str(raw / "tokenizer")


def _varying_load(args, max_images: int) -> int:
    from megatron_mllm.runtime.planning.schedules import adaptive_planner

    setup = _setup(args, max_images)
    repeats = [_one_repeat(setup, args) for _ in range(args.repeats)]
    result = _summary(setup, repeats, args)
    planner = adaptive_planner(setup["jobs"]["optimus_adaptive"])
    if planner is not None:
        steps, n, cfg = range(1, args.steps + 1), setup["n"], setup["cfg"]
        times = setup["jobs"]["optimus_adaptive"].executor.plan_times
        read = step_batches(setup["jobs"], max(steps) + 1, n, setup["per_token"])
        result.update(predicted(planner, read, steps, cfg, times))
        if cfg.vit_native:  # the same, the micro-batches weighed by the flop count alone
            flops = predicted(planner, read, steps, cfg, None)
            result["predicted_adaptive_vs_static_flops"] = flops["predicted_adaptive_vs_static"]
            result["tower_profile"] = times["vit"]["tower"]
    if args.json:
        print(json.dumps(result))
        return 0
    _print(result, setup, args)
    return 0


def _model(args, max_images: int, vocab: int):
    """The benchmark's model: BENCH, or with --native-resolution a native tower (4 layers of
    256, patches of 4 merged 2 x 2) and a Qwen2-style backbone on packed rows; its data."""
    from megatron_mllm.data.llava_source import LlavaData
    from megatron_mllm.models.config import BENCH

    if not args.native_resolution:
        # The most images a sample has, 64 tokens each, and its conversation (128 positions).
        seq = max_images * BENCH.image_tokens + 128
        cfg = replace(BENCH, vocab_size=vocab, text_len=seq - BENCH.image_tokens)
        return cfg, LlavaData(args.data_path, args.tokenizer_model, seq, num_workers=1)
    native = dict(vit_native=True, vit_activation="quick_gelu", vit_norm_eps=1e-6, patch_size=4,
                  image_size=32, vit_layers=4, vit_hidden=256, vit_heads=4,
                  llm_mrope_section=(8, 12, 12), llm_qkv_bias=True)  # fmt: skip
    cfg = replace(BENCH, vocab_size=vocab, **native)
    cfg = replace(cfg, text_len=NATIVE_SEQ - cfg.image_tokens)
    data = LlavaData(args.data_path, args.tokenizer_model, NATIVE_SEQ, num_workers=1,
                     **NATIVE_PIXELS, packing_buffer_size=16)  # fmt: skip
    return cfg, data


def _setup(args, max_images: int) -> dict:
    """Profile the units (both ranks at once), plan the static schedules, build every run."""
    import argparse

    import torch
    from bench_common import bench_run

    from megatron_mllm.data.tokenizer import load_tokenizer
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import ExecutorSettings, PlanParts
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.planning.profile_units import profile_units
    from megatron_mllm.schedule.baselines import megatron_schedule
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.schedule.planner import plan_optimus
    from megatron_mllm.training.run_config import encoder_load

    if args.tokenizer_model is None:
        raise SystemExit("error: --data-path needs --tokenizer-model DIR (its tokenizer)")
    vocab = -(-len(load_tokenizer(args.tokenizer_model)) // 128) * 128
    cfg, data = _model(args, max_images, vocab)
    plan = ParallelPlan(2, 1, 1) if args.dp == 2 else ParallelPlan(1, 1, 2)
    n, mb = args.microbatches, max(args.micro_batch, 2)
    state = spawn(make_full_state, 1, cfg, 0)[0]
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    measured = spawn(profile_units, plan.world_size, cfg, mb, 5, dtype, args.ddp_bucket_size)[0]
    loaded = argparse.Namespace(data_path=args.data_path, micro_batch_size=mb, **NATIVE_PIXELS)
    load = encoder_load(loaded, cfg, measured)  # a native tower's as profiled
    per_token = args.calculate_per_token_loss or args.native_resolution  # packed rows need it
    run = bench_run(cfg, args, plan, n, mb, *(["--calculate-per-token-loss"] * per_token))
    costs = JobCosts(replace(run.planning_job(), images_per_sample=load), measured, unit="layer")
    balanced = megatron_schedule(costs)
    best, _, _ = plan_optimus(costs)
    bf16 = args.precision == "bf16"
    base = replace(run.runtime_job(None, state), steps=args.steps + 1)
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
            # the measured times weigh the samples a native tower deals (its profile)
            executor=executor or ExecutorSettings(plan_times=measured),
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
        # the ablation: the next step planned inside the step, not in a background thread
        jobs["optimus_adaptive_in_step"] = job(
            PlanParts(plan, schedule=best.schedule),
            executor=replace(adaptive, plan_in_step=True),
            balance=True,
        )
    return dict(cfg=cfg, plan=plan, n=n, mb=mb, load=load, jobs=jobs, best=best,
                per_token=per_token)  # fmt: skip


def _one_repeat(setup: dict, args) -> dict:
    """Every run in one 2-process job, steps taken in turn: each run's per-step times (the
    slowest rank's), losses and adaptive's planning facts."""
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.modes.runs import run_interleaved

    jobs, steps = setup["jobs"], args.steps + 1
    per_rank = spawn(run_interleaved, setup["plan"].world_size, list(jobs.values()), steps)
    out: dict = {"times": {}, "losses": {}, "limit": {}}
    for i, name in enumerate(jobs):
        ranks = [rank_results[i] for rank_results in per_rank]
        out["times"][name] = [max(o["seconds"][s] for o in ranks) for s in range(1, steps)]
        if "compute_seconds" in ranks[0]:  # our executor's runs: their zero-bubble limit,
            # every rank's compute in the step spread evenly over the ranks. No assignment of
            # the step's samples and no schedule changes that sum.
            out["limit"][name] = [sum(o["compute_seconds"][s] for o in ranks) / len(ranks)
                                  for s in range(1, steps)]  # fmt: skip
        if setup["per_token"]:  # samples change micro-batches: the step's per-token mean
            out["losses"][name] = [{"step": v} for v in ranks[0]["mean_losses"]]
        else:
            out["losses"][name] = [
                {k: v for o in ranks for k, v in o["history"][s].items()} for s in range(steps)
            ]
        if name == "optimus_adaptive":
            stats, orders = ranks[0]["step_plans"], ranks[0]["step_orders"]
            out["planned_steps"], out["fallbacks"] = stats.planned, stats.fallbacks
            out["reordered_steps"] = sum(o is not None and o != sorted(o) for o in orders)
            out["plan_seconds"] = list(ranks[0]["step_plan_seconds"])
    return out


def _paired(times: dict, a: str, b: str) -> float:
    """The median over steps of run a's step time over run b's (the same step's data)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def _over_limit(repeat: dict, name: str) -> float:
    """The median over steps of run `name`'s step over its zero-bubble limit (the same step)."""
    pairs = zip(repeat["times"][name], repeat["limit"][name], strict=True)
    return statistics.median(t / lim for t, lim in pairs)


def _summary(setup: dict, repeats: list[dict], args) -> dict:
    """Medians (and min-max) over repeats of each run's median step and of the paired ratios;
    planning facts summed over repeats."""
    jobs, per_token = setup["jobs"], setup["per_token"]

    from bench_common import over_repeats as over

    result = {
        "microbatches": setup["n"],
        "micro_batch": setup["mb"],
        "repeats": args.repeats,
        "measured_steps": args.steps,
        "seq_length": setup["cfg"].seq_len,
        "images_per_sample": setup["load"],
        "per_token_loss": per_token,
        "native_resolution": bool(args.native_resolution),
        "dp": setup["plan"].dp,
        "pp": setup["plan"].pp,
        "encoder_plan": str(setup["best"].options.encoder_plan),
    }
    for name in jobs:
        med, lo, hi = over([statistics.median(r["times"][name]) for r in repeats])
        result[f"{name}_s"], result[f"{name}_range_s"] = med, (lo, hi)
    pairs = [("adaptive_vs_static", "optimus", "optimus_adaptive")]
    if per_token:
        pairs.append(("balanced_samples_vs_static", "optimus", "optimus_balanced"))
        pairs.append(("adaptive_in_step_vs_static", "optimus", "optimus_adaptive_in_step"))
    for key, a, b in pairs:
        med, lo, hi = over([_paired(r["times"], a, b) for r in repeats])
        result[key], result[f"{key}_min"], result[f"{key}_max"] = med, lo, hi
        result[f"{key}_range"] = (lo, hi)
    # The most any balancing or per-step plan can gain over each run, as measured.
    over_limit = {"optimus": "static_over_limit", "optimus_adaptive": "adaptive_over_limit"}
    for name, key in over_limit.items():
        med, lo, hi = over([_over_limit(r, name) for r in repeats])
        result[key], result[f"{key}_min"], result[f"{key}_max"] = med, lo, hi
    for key in ("planned_steps", "fallbacks", "reordered_steps"):
        result[key] = sum(r[key] for r in repeats)
    secs = [x for r in repeats for x in r["plan_seconds"]]
    result["plan_seconds_mean"] = statistics.mean(secs) if secs else 0.0
    result["plan_seconds_max"] = max(secs) if secs else 0.0
    result["adaptive_vs_megatron_core"] = (
        result["megatron_core_1f1b_s"] / result["optimus_adaptive_s"]
    )
    result["max_abs_loss_diff_adaptive_vs_static"] = max(
        abs(a[k] - b[k])
        for r in repeats
        for a, b in zip(r["losses"]["optimus"], r["losses"]["optimus_adaptive"], strict=True)
        for k in a
    )
    return result


def _print(result: dict, setup: dict, args) -> None:
    native = args.native_resolution
    what = "native-resolution packed digits" if native else "BENCH MLLM"
    unit = "nominal images (by patches)" if native else "images"
    source = args.images_per_sample or (NATIVE_IMAGES if native else args.data_path)
    print(
        f"{what} on {source} ({result['images_per_sample']:.2f} {unit} per sample planned), "
        f"sequence {result['seq_length']}, DP {result['dp']} x PP {result['pp']} on 2 ranks x "
        f"1 thread, {setup['n']} micro-batches of {setup['mb']}, {args.repeats} repeats of "
        f"{args.steps} steps; Optimus encoder {result['encoder_plan']}"
    )
    print(f"{'run':<20}{'step s':>9}{'min-max over repeats':>22}{'vs mcore':>10}")
    base = result["megatron_core_1f1b_s"]
    for name in setup["jobs"]:
        (lo, hi), step = result[f"{name}_range_s"], result[f"{name}_s"]
        print(f"{name:<20}{step:>9.3f}{lo:>13.3f}-{hi:<8.3f}{base / step:>9.2f}x")
    print(
        f"optimus_adaptive vs optimus, paired per step, median over repeats: "
        f"{result['adaptive_vs_static']:.3f}x (min-max {result['adaptive_vs_static_min']:.3f}-"
        f"{result['adaptive_vs_static_max']:.3f}); {result['planned_steps']} steps planned "
        f"({result['reordered_steps']} with micro-batches in other slots), "
        f"{result['fallbacks']} fallback(s), planning {1000 * result['plan_seconds_mean']:.1f} ms "
        f"CPU a step (max {1000 * result['plan_seconds_max']:.1f}); max |loss diff| "
        f"{result['max_abs_loss_diff_adaptive_vs_static']:.2e}"
        + (" (the steps' per-token means)" if setup["per_token"] else "")
    )
    if "predicted_adaptive_vs_static" in result:
        print(
            "simulator on the measured steps' loads (unit times profiled in this run): "
            f"static {result['predicted_optimus_s']:.3f} s, adaptive "
            f"{result['predicted_optimus_adaptive_s']:.3f} s, "
            f"adaptive vs static {result['predicted_adaptive_vs_static']:.3f}x"
            + (
                f" ({result['predicted_adaptive_vs_static_flops']:.3f}x with the loads by flops "
                "alone, not the tower's profile)"
                if "predicted_adaptive_vs_static_flops" in result
                else ""
            )
            + (
                f", dealing alone {result['predicted_balanced_samples_vs_static']:.3f}x"
                if setup["per_token"]
                else ""
            )
        )
    if setup["per_token"]:
        print(
            f"optimus_balanced vs optimus, paired per step: "
            f"{result['balanced_samples_vs_static']:.3f}x (min-max "
            f"{result['balanced_samples_vs_static_min']:.3f}-"
            f"{result['balanced_samples_vs_static_max']:.3f})"
        )
        print(
            f"optimus_adaptive_in_step (the next step planned in the step, no thread) vs "
            f"optimus, paired per step: {result['adaptive_in_step_vs_static']:.3f}x (min-max "
            f"{result['adaptive_in_step_vs_static_min']:.3f}-"
            f"{result['adaptive_in_step_vs_static_max']:.3f})"
        )
    print(
        "the bound: static Optimus's step over its zero-bubble limit (every rank's compute "
        "spread evenly; no balancing or plan gains more), paired per step: "
        f"{result['static_over_limit']:.3f}x (min-max {result['static_over_limit_min']:.3f}-"
        f"{result['static_over_limit_max']:.3f}); optimus_adaptive's "
        f"{result['adaptive_over_limit']:.3f}x"
    )


def step_batches(jobs: dict, steps: int, n: int, per_token: bool) -> dict:
    """The first `steps` steps' micro-batches, [step][replica][micro-batch], as the loader
    gives them ("loader") and, with a per-token loss, as the adaptive run deals them
    ("dealt")."""
    from megatron_mllm.runtime.inputs.batches import StepData

    replicas = list(range(jobs["optimus"].backbone.dp))
    readers = {"loader": StepData(jobs["optimus"], replicas)}
    if per_token:
        readers["dealt"] = StepData(jobs["optimus_adaptive"], replicas)
    out: dict = {k: [] for k in readers}
    for step in range(steps):
        for k, reader in readers.items():
            get = reader.step(step)
            out[k].append([[get(m, dp) for m in range(n)] for dp in replicas])
    for reader in readers.values():
        reader.close()
    return out


def predicted(planner, batches: dict, steps, cfg, times) -> dict:
    """The simulator's step-time ratios on the measured steps' real micro-batch loads
    (`step_batches`; medians over the steps; a step is its slowest replica; a native tower's
    loads weighed by the profile in the measured `times`, by the flop count without): static
    Optimus on the loader's micro-batches against the per-step plan (on the dealt ones with a
    per-token loss) and, with a per-token loss, against the static plan on the dealt ones."""
    from megatron_mllm.runtime.inputs.batches import encoder_load
    from megatron_mllm.schedule.adaptive import timed_step
    from megatron_mllm.schedule.loads import loader_assignment

    per_token = "dealt" in batches
    static = planner.static
    one = loader_assignment(len(batches["loader"][0][0]), 1, 1)

    def static_s(loads: list[float]) -> float:
        return timed_step(static.schedule, static.workload, loads, one, planner.costed)[
            1
        ].step_time_s

    loads = {  # [step][replica] -> micro-batch loads
        k: [[[encoder_load(b, cfg, times) for b in r] for r in step] for step in read]
        for k, read in batches.items()
    }
    mine = loads["dealt" if per_token else "loader"]

    def step_s(time, per_replica) -> float:
        return max(time(x) for x in per_replica)

    def adaptive_s(x: list[float]) -> float:
        return planner.plan(x).step_time_s

    as_loaded = [step_s(static_s, loads["loader"][s]) for s in steps]
    adaptive = [step_s(adaptive_s, mine[s]) for s in steps]
    out = {
        "predicted_adaptive_vs_static": statistics.median(map(truediv, as_loaded, adaptive)),
        # the seconds themselves (medians over the steps), beside the runs' measured ones
        "predicted_optimus_s": statistics.median(as_loaded),
        "predicted_optimus_adaptive_s": statistics.median(adaptive),
    }
    if per_token:
        dealt = [step_s(static_s, mine[s]) for s in steps]
        out["predicted_balanced_samples_vs_static"] = statistics.median(
            map(truediv, as_loaded, dealt)
        )
        out["predicted_optimus_balanced_s"] = statistics.median(dealt)
    return out

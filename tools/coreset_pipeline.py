"""The coreset benchmark's step-time comparison on a 2-stage pipeline (`bench_coreset.py
--pipeline-steps N`): B alone, 2B by accumulation, the coreset (pool pass, selection, step) and
the coreset with look-ahead (the next pool in the step's bubbles), built in the same two
processes and stepped in turn, repeated in fresh processes; each rank's phases per step."""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from dataclasses import asdict, replace

# The look-ahead runs: --coreset-lookahead-order's default (the order simulation chose), the
# whole next pool first (and selected before the update: the ablation), and searched.
LOOKAHEADS = (
    "coreset_lookahead",
    "coreset_lookahead_pool_first",
    "coreset_lookahead_pool_first_select_before",
    "coreset_lookahead_searched",
)
RUNS = ("B", "2B_accumulation", "coreset", "coreset_whole_pool", *LOOKAHEADS)


def check_runs(names: list[str]) -> str | None:
    """What is wrong with `--pipeline-runs` (None where nothing): known names, the same-step
    coreset (every ratio's denominator) and at least one look-ahead among them."""
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        return f"--pipeline-runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}"
    if "coreset" not in names or not any(n in LOOKAHEADS for n in names):
        return "--pipeline-runs must hold coreset and at least one coreset_lookahead* run"
    return None


def pipeline_jobs(args) -> dict:
    """The step-time runs on a 2-stage pipeline (Optimus, distributed optimizer): B
    alone, 2B by accumulation (2N micro-batches, B's memory), the coreset (the pool's pass, then
    the step) and the coreset with look-ahead (the next pool in the step's bubbles)."""
    from bench_common import bench_run
    from bench_data.coreset_tasks import mllm_config

    from megatron_mllm.data.coreset import CoresetConfig
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.planning.profile_units import profile_units
    from megatron_mllm.runtime.planning.schedules import pool_plan, runtime_plan
    from megatron_mllm.schedule.lookahead import SHIFTS, with_lookahead, with_searched_counts

    cfg, plan, mb = mllm_config(args, text_len=args.pipeline_text), ParallelPlan(1, 1, 2), 2
    n = args.pipeline_batch // mb
    state = spawn(make_full_state, 1, cfg, 0)[0]
    # Plans and the merge from unit times measured here, both ranks at once (their contention).
    measured = spawn(profile_units, plan.world_size, cfg, mb, 5)[0]
    step, workload = runtime_plan(cfg, plan, mb, n, "optimus", measured=measured)
    pool, _ = pool_plan(step, cfg, plan, mb, 2 * n, measured=measured)
    double, _ = runtime_plan(cfg, plan, mb, 2 * n, "optimus", measured=measured)
    coreset = CoresetConfig(batch_size=args.pipeline_batch, pool_ratio=2, features="zo", seed=0)
    merged = with_lookahead(step, pool, workload, SHIFTS["simulated"])
    first = with_lookahead(step, pool, workload, SHIFTS["pool-first"])
    searched = None
    if "coreset_lookahead_searched" in args.pipeline_runs:  # a search per count: ~4 s each
        searched = with_searched_counts(merged, workload, range(1, 2 * n))

    # fp32: bf16 matrix products are ~65x slower on this CPU
    fp32 = argparse.Namespace(precision="fp32")
    run = bench_run(cfg, fp32, plan, n, mb, "--lr", "1e-3", "--use-distributed-optimizer")
    base = run.runtime_job(step, state, units="layer")

    # --pipeline-replan: every run planned again on the unit times its warm-up step measured
    executor = replace(base.executor, replan_after=1 if args.pipeline_replan else None)

    def job(schedule, n_mb, **data):
        plans = replace(base.plans, schedule=schedule)
        data = replace(base.data, num_microbatches=n_mb, **data)
        return replace(base, plans=plans, data=data, executor=executor)

    def ahead(merge, order: str):  # a look-ahead run: the merge and the order a re-plan keeps
        return job(step, n, coreset=coreset, pool_schedule=pool, lookahead_schedule=merge,
                   lookahead_order=order)  # fmt: skip

    jobs = {
        "B": job(step, n),
        "2B_accumulation": job(double, 2 * n),
        "coreset": job(step, n, coreset=coreset, pool_schedule=pool),
        "coreset_whole_pool": job(step, n, coreset=coreset, pool_schedule=pool),
        "coreset_lookahead": ahead(merged, "simulated"),
        "coreset_lookahead_pool_first": ahead(first, "pool-first"),
        "coreset_lookahead_pool_first_select_before": ahead(first, "pool-first"),
        "coreset_lookahead_searched": ahead(searched, "searched"),
    }
    jobs = {name: job for name, job in jobs.items() if name in args.pipeline_runs}
    describe = (
        f"PP=2 on 2 ranks, Optimus, fp32 + distributed optimizer, ViT {cfg.vit_layers}x"
        f"{cfg.vit_hidden} + GPT {cfg.llm_layers}x{cfg.llm_hidden}, sequence {cfg.seq_len}, "
        f"synthetic image-caption pools (10 classes), B={args.pipeline_batch} in micro-batches "
        f"of {mb}"
    )
    predicted = {name: lookahead_times(jobs[name]) for name in LOOKAHEADS if name in jobs}
    return {"jobs": jobs, "describe": describe, "predicted": predicted}


def timed_phases(run) -> dict:
    """Wraps `run`'s coreset pool pass (forward, selection, the rows' broadcast), its
    selection and the pool program's run so that their seconds (and the pool program's message
    waits) add up in the returned dict (this rank's)."""
    from megatron_mllm.runtime.engine.breakdown import breakdown_of_spans
    from megatron_mllm.runtime.engine.step_types import PassKind

    spent = {"pool_pass_s": 0.0, "selection_s": 0.0, "pool_wait_s": 0.0}
    coreset = run.coreset
    if coreset is None:
        return spent

    def timer(inner, key: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            spent[key] += time.perf_counter() - t0
            return out

        return timed

    def pool_waits(executor, result, kind) -> None:
        if kind == PassKind.POOL:
            spent["pool_wait_s"] += breakdown_of_spans(result.spans, result.seconds).wait_s

    after_each_program(run, pool_waits)
    coreset.pool_rows = timer(coreset.pool_rows, "pool_pass_s")
    coreset._pick_scored = timer(coreset._pick_scored, "selection_s")
    return spent


def after_each_program(run, hook) -> None:
    """Wraps `run`'s executors so that `hook(executor, result, kind)` runs after each program
    (`kind`: the pass's, None for a training step)."""

    def executor_for(*a, inner=run.executor_for, **kw):
        executor = inner(*a, **kw)
        run_step = executor.run_step

        def hooked():
            result = run_step()
            hook(executor, result, kw.get("kind"))
            return result

        executor.run_step = hooked
        return executor

    run.executor_for = executor_for


def traced(run, into: list) -> None:
    """Each program `run` runs appends (its start on the host clock, its top-level trace) to
    `into` (for `replay.decomposition`; CPU)."""
    from megatron_mllm.runtime.engine.replay import top_level

    def record(executor, result, kind) -> None:  # noqa: ARG001 - every kind of pass
        into.append((executor.clock.start, top_level(result.spans)))

    after_each_program(run, record)


# Consecutive steps a run takes between two barriers: the look-ahead's selection overlaps the
# next step's start on the other stages, which a barrier after every step would forbid.
BLOCK = 5


def pipeline_steps(rank: int, world: int, jobs: dict, steps: int) -> dict:
    """Every run builds once, then they take turns: one warm-up step each, then blocks of
    `BLOCK` steps, each block's wall time from a barrier before it to a barrier after it (the
    slower rank's time) shared out over its steps; and this rank's phases per step: the pool
    pass, the selection, the training program's seconds, compute and message waits; and per
    step its programs' (host-clock start, trace), for the replay."""
    import torch.distributed as dist

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.runs import make_run

    device = init_rank(rank, world, 0, 120.0)
    runs = {name: make_run(rank, world, job, device) for name, job in jobs.items()}
    for name, run in runs.items():
        if name.endswith("_select_before"):  # the ablation: selected before the update
            run.coreset.defer = False
        if name == "coreset_whole_pool":  # the ablation: every pool row goes forward
            run.coreset.score_only = False
    spent = {name: timed_phases(run) for name, run in runs.items()}
    ran = {name: [] for name in runs}  # the programs run so far: (start, trace)
    for name, run in runs.items():
        traced(run, ran[name])
    traces = {name: [] for name in runs}  # per step: its programs' (start, trace)
    times = {name: [] for name in runs}
    phases = {name: [] for name in runs}
    waits = {name: [] for name in runs}  # per step: the program's waits by message
    blocks = [(0, 1)] + [(s, min(BLOCK, steps - s)) for s in range(1, steps, BLOCK)]
    for first, count in blocks:
        for name, run in runs.items():
            before = dict(spent[name])
            dist.barrier()
            t0 = time.perf_counter()
            for step in range(first, first + count):
                done = len(ran[name])
                run.step(step)
                traces[name].append(ran[name][done:])
            dist.barrier()
            times[name] += [(time.perf_counter() - t0) / count] * count
            if run.job.executor.replan_after == first + count:  # collective, untimed
                run.replan()
            for program in run.breakdowns[-count:]:
                phases[name].append({
                    **{k: (v - before[k]) / count for k, v in spent[name].items()},
                    "program_s": program.seconds, "compute_s": program.compute_s,
                    "wait_s": program.wait_s,
                })  # fmt: skip
                waits[name].append(program.wait_by_message)
    predicted = {name: lookahead_times(run.job) for name, run in runs.items()}
    return {"times": times, "phases": phases, "waits": waits, "traces": traces,
            "predicted": predicted}  # fmt: skip


def lookahead_times(job) -> dict | None:
    """A look-ahead job's predicted step, step alone and pool alone (seconds), else None."""
    merged = job.data.lookahead_schedule
    return None if merged is None else asdict(merged.lookahead_times)


def pipeline_section(args) -> dict:
    """Per run, the median step seconds over every repeat's measured steps (one warm-up step
    each, then blocks of `BLOCK` steps; a repeat is two fresh processes), the look-ahead's
    paired ratio per repeat, and each rank's phases (medians over every measured step)."""
    from megatron_mllm.runtime.assembly.launch import spawn

    built = pipeline_jobs(args)
    steps = {name: [] for name in built["jobs"]}
    phases = {name: [[], []] for name in built["jobs"]}
    waits = {name: [[], []] for name in built["jobs"]}
    lookaheads = [name for name in LOOKAHEADS if name in built["jobs"]]
    ratios = {name: [] for name in lookaheads}
    # Against the same-step selection forwarding the whole pool, as the look-ahead does
    whole = {name: [] for name in ("coreset", *lookaheads)} if "coreset_whole_pool" in steps else {}
    logs = {name: ([], []) for name in lookaheads}  # every measured step's log seconds, paired
    programs = {name: {} for name in built["jobs"]}  # program index -> per step, per rank
    replanned = {name: [] for name in lookaheads}  # each repeat's merge made in the job
    for _ in range(args.repeats):
        ranks = spawn(pipeline_steps, 2, built["jobs"], args.pipeline_steps + 1, timeout_s=7200)
        if args.pipeline_replan:
            for name in lookaheads:
                replanned[name].append(ranks[0]["predicted"][name])
        times = {name: ts[1:] for name, ts in ranks[0]["times"].items()}
        for name, ts in times.items():
            steps[name] += ts
            for r in range(2):
                phases[name][r] += ranks[r]["phases"][name][1:]
                waits[name][r] += ranks[r]["waits"][name][1:]
            for both in zip(*(ranks[r]["traces"][name][1:] for r in range(2)), strict=True):
                for j, pair in enumerate(zip(*both, strict=True)):
                    programs[name].setdefault(j, []).append(list(pair))
        for name in lookaheads:
            pairs = [a / c for a, c in zip(times[name], times["coreset"], strict=True)]
            ratios[name].append(statistics.median(pairs))
            logs[name][0].extend(math.log(t) for t in times[name])
            logs[name][1].extend(math.log(t) for t in times["coreset"])
        for name, r in whole.items():
            pairs = [a / c for a, c in zip(times[name], times["coreset_whole_pool"], strict=True)]
            r.append(statistics.median(pairs))
    out = {"describe": built["describe"], "predicted": built["predicted"], "runs": {}}
    if args.pipeline_replan:  # what the planner predicted on the times each repeat measured
        out["predicted_replanned"] = replanned
    acc = statistics.median(steps.get("2B_accumulation") or [math.nan])
    for name, ts in steps.items():
        med = statistics.median(ts)
        out["runs"][name] = {
            "step_s": med, "min_s": min(ts), "max_s": max(ts), "vs_accumulation": med / acc,
            "ranks": [{k: statistics.median(p[k] for p in rank) for k in rank[0]}
                      for rank in phases[name]],
        }  # fmt: skip
        for rank, steps_waits in zip(out["runs"][name]["ranks"], waits[name], strict=True):
            rank["top_waits"] = top_waits(steps_waits)
    out["lookahead_vs_coreset"] = {
        name: (statistics.median(r), min(r), max(r)) for name, r in ratios.items()
    }
    out["lookahead_vs_coreset_interval"] = {name: ratio_interval(*logs[name]) for name in logs}
    out["vs_coreset_whole_pool"] = {
        name: (statistics.median(r), min(r), max(r)) for name, r in whole.items()
    }
    out["repeats"] = args.repeats
    out["replayed"] = replayed(programs, built["jobs"])
    return out


def replayed(programs: dict, jobs: dict) -> dict:
    """Per run, per program of a step (the same-step run: the pool pass, then the step), the
    replay's decomposition (`runtime/engine/replay.py`), medians over the measured steps."""
    from megatron_mllm.runtime.engine.replay import decomposition

    return {
        name: [decomposition(steps, jobs[name].num_microbatches) for _, steps in sorted(p.items())]
        for name, p in programs.items()
    }


def predicted_ratio(times: dict) -> float:
    """A look-ahead's predicted step over the step and the pool pass apart."""
    return times["step_s"] / (times["step_alone_s"] + times["pool_alone_s"])


def top_waits(steps: list[dict[str, float]], keep: int = 6) -> dict[str, float]:
    """The `keep` messages a rank waited longest for, in seconds per step (means over
    `steps`, each a program's waits by message)."""
    from megatron_mllm.runtime.engine.breakdown import mean_waits

    return dict(list(mean_waits(steps).items())[:keep])


def ratio_interval(log_a: list[float], log_b: list[float]) -> tuple[float, float, float]:
    """The geometric mean of the paired ratios a / b over every measured step and its 95%
    interval (Student's t on the paired log differences), as (ratio, low, high)."""
    from paired_stats import paired_interval

    c = paired_interval(log_a, log_b)
    return math.exp(c.mean), math.exp(c.low), math.exp(c.high)


def print_pipeline(p: dict) -> None:
    print(f"step time on a pipeline: {p['describe']}; medians over the measured steps (min-max)")
    for name, r in p["runs"].items():
        acc = r["vs_accumulation"]
        vs = "" if math.isnan(acc) else f"{acc:>7.2f}x accumulation"
        print(f"  {name:<44}{1000 * r['step_s']:>9.1f} ms ({1000 * r['min_s']:.1f}-"
              f"{1000 * r['max_s']:.1f}){vs}")  # fmt: skip
    print("  per rank (medians, ms): pool pass (incl. selection; its message waits) | selection |"
          " training program = compute + message waits + executor overhead")  # fmt: skip
    for name, r in p["runs"].items():
        cells = "; ".join(
            f"rank {i}: {1000 * k['pool_pass_s']:.0f} ({1000 * k['pool_wait_s']:.0f}) | "
            f"{1000 * k['selection_s']:.0f} | "
            f"{1000 * k['program_s']:.0f} = {1000 * k['compute_s']:.0f} + "
            f"{1000 * k['wait_s']:.0f} + "
            f"{1000 * (k['program_s'] - k['compute_s'] - k['wait_s']):.0f}"
            for i, k in enumerate(r["ranks"])
        )
        print(f"  {name:<44}{cells}")
        for i, k in enumerate(r["ranks"]):
            top = ", ".join(f"{key} {1000 * v:.0f}" for key, v in k["top_waits"].items())
            print(f"  {'':<44}rank {i} waited longest for (ms a step): {top}")
    print("  replayed (ms, medians): the program = host gaps + start skew + message posting + "
          "action variation + the schedule's idle + the busiest rank's compute")  # fmt: skip
    order = ("measured_s", "replay_s", "no_skew_s", "no_message_host_s", "median_durations_s",
             "compute_s")  # fmt: skip
    for name, parts in p["replayed"].items():
        labels = ("pool pass", "step") if len(parts) == 2 else ("",) * len(parts)
        for label, part in zip(labels, parts, strict=True):
            ms = [1000 * part[k] for k in order]
            terms = " + ".join(f"{a - b:.0f}" for a, b in itertools.pairwise(ms))
            print(f"  {f'{name} {label}':<44}{ms[0]:.0f} = {terms} + {ms[-1]:.0f}")
    for name, (med, lo, hi) in p["lookahead_vs_coreset"].items():
        geo, low, high = p["lookahead_vs_coreset_interval"][name]
        again = p.get("predicted_replanned", {}).get(name)
        said = f"{predicted_ratio(p['predicted'][name]):.3f} at start-up"
        if again:
            said += ", " + " / ".join(f"{predicted_ratio(x):.3f}" for x in again) + " re-planned"
        print(f"  {name} / same-step coreset, paired by block: {med:.3f} ({lo:.3f}-{hi:.3f}) over "
              f"{p['repeats']} repeats (each repeat's median); over every step {geo:.3f} "
              f"(95% interval {low:.3f}-{high:.3f}); the planner predicted {said}")  # fmt: skip
    for name, (med, lo, hi) in p["vs_coreset_whole_pool"].items():
        print(f"  {name} / same-step coreset forwarding the whole pool (the ablation): "
              f"{med:.3f} ({lo:.3f}-{hi:.3f}) over {p['repeats']} repeats")  # fmt: skip

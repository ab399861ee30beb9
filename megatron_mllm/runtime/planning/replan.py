"""Online re-planning: replace the cost model's estimates with the unit times the executor
measured, and plan the Optimus schedule again for the same modules.

The encoder's units are timed one by one (layer- or kernel-sized, as the run executes them);
the backbone is timed per layer (a chunk's F or B over its layer count, so the first chunk
carries the embedding) and the LM head apart on the last stage ("head" / "head_b", as the unit
profile times it; engine/head_timing.py). In kernel-granularity plans the backbone's kernels
keep the analytic proportions, scaled to the measured layer time. The encoder plan and the
backbone's layer split stay what they are (both are built into the modules); the planner
re-decides micro-batch splits, warm-up, placement into bubbles and TP fills.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import optimus_schedule
from megatron_mllm.schedule.config import MLLMJob
from megatron_mllm.schedule.planner import plan_optimus
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import validate
from megatron_mllm.schedule.workload import Workload

if TYPE_CHECKING:
    from megatron_mllm.runtime.job import RuntimeJob


def measured_times(
    samples: list[dict[tuple[str, str, str], list[float]]],
    job_costs: JobCosts,
    unit: str,
) -> dict[str, dict[str, dict[str, float]]]:
    """Mean unit times over every rank's samples, in the cost model's measured-times form (a
    step is a sum of units: means add up to its time; medians of skewed samples fall short)."""
    merged: dict[tuple[str, str, str], list[float]] = {}
    for rank_samples in samples:
        for key, values in rank_samples.items():
            merged.setdefault(key, []).extend(values)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (model, direction, name), values in merged.items():
        out.setdefault(model, {}).setdefault(direction, {})[name] = statistics.fmean(values)
    llm = out.pop("llm", {})
    if "collectives" in llm:  # the backbone's TP collectives, measured apart from its compute
        out.setdefault("llm", {})["collectives"] = llm["collectives"]
    if unit == "kernel" and llm:  # per-kernel backbone times: analytic shares of the layer
        block = job_costs.backbone_layer(job_costs.job.tp)
        for direction, kernels, name in (
            ("forward", block.fwd, "layer"),
            ("backward", block.bwd, "layer_b"),
        ):
            layer = llm.get(direction, {}).get(name)
            analytic = sum(k.compute_s for k in kernels)
            if layer is not None and analytic > 0:
                out.setdefault("llm", {})[direction] = {
                    k.name: k.compute_s * layer / analytic for k in kernels
                }
            head = "head" if direction == "forward" else "head_b"
            if head in llm.get(direction, {}):  # the LM head, timed apart on the last stage
                out.setdefault("llm", {}).setdefault(direction, {})[head] = llm[direction][head]
    elif llm:
        out.setdefault("llm", {}).update(llm)
    return out


def replan(
    planning: MLLMJob,
    current: Schedule,
    encoder_plan: ParallelPlan,
    samples: list[dict],
    unit: str,
) -> tuple[Schedule, Workload, dict] | None:
    """The best Optimus schedule under the measured times for the current encoder plan and
    backbone split (`planning`'s), with the times used; None where the best one needs another
    layer split. Where `current` splits the encoder's backward (EW actions) or the backbone's
    (W actions), so does the new one (its best options, split; None where that does not fit
    in memory)."""
    times = measured_times(samples, JobCosts(planning, unit=unit), unit)
    costs = JobCosts(planning, times, unit=unit)
    best, _, _ = plan_optimus(costs, encoder_plan=encoder_plan)
    if best.schedule.meta.backbone_layers != current.meta.backbone_layers:
        return None
    splits = current.meta.split_options()
    if any(splits.values()):
        schedule, workload = optimus_schedule(costs, replace(best.options, **splits))
        validate(schedule)
        if simulate(schedule, workload).peak_memory_gb > planning.hw.memory_gb:
            return None  # the split holds output gradients the re-planned options may not fit
        return schedule, workload, times
    return best.schedule, best.workload, times


def measured_workload(job: RuntimeJob, samples: list[dict]) -> Workload | None:
    """The costs of `job`'s schedule with the unit and TP-collective times measured in the
    job (`samples`: every rank's; they need not come from this schedule: units are the
    model's, whatever the schedule); None where its costs cannot be rebuilt (the rebuilt
    layout has another backbone split)."""
    from megatron_mllm.runtime.job import encoder_plan_of
    from megatron_mllm.runtime.planning.schedules import plan_job, planning_job

    schedule, unit = job.schedule, job.plans.encoder_units
    planning = planning_job(job, schedule.meta.num_microbatches)
    times = measured_times(samples, JobCosts(planning, unit=unit), unit)
    enc_plan, stage0 = encoder_plan_of(schedule, job.backbone)
    for name in ("megatron", "balanced") if stage0 else ("optimus",):
        encoders = None if stage0 else enc_plan
        split = {} if stage0 else {"wgrad_split": schedule.meta.splits_weight_grads}
        rebuilt, workload = plan_job(planning, name, encoders, times, unit, **split)
        if rebuilt.meta.backbone_layers == schedule.meta.backbone_layers:
            workload.check_matches(schedule.meta)
            return workload
    return None


def replan_job(job: RuntimeJob, samples: list[dict]) -> tuple[Schedule, Workload, dict] | None:
    """`replan` for a RuntimeJob's own model, plans and schedule; None where its encoder sits
    on stage 0 (nothing to re-plan for the same modules) or the new plan needs other ones."""
    from megatron_mllm.runtime.job import encoder_plan_of
    from megatron_mllm.runtime.planning.schedules import planning_job

    enc_plan, stage0 = encoder_plan_of(job.schedule, job.backbone)
    if stage0:
        return None
    return replan(planning_job(job), job.schedule, enc_plan, samples, job.plans.encoder_units)


def predicted_with_measured(job: RuntimeJob, samples: list[dict]) -> float | None:
    """The simulator's step time for `job`'s schedule under the times measured in `samples`
    (every rank's); None where its costs cannot be rebuilt."""
    workload = measured_workload(job, samples)
    return None if workload is None else simulate(job.schedule, workload).step_time_s


def calibrated(workload: Workload, overhead_s: float, latency_s: float) -> Workload:
    """`workload` with a fixed host overhead before every compute action and a latency on
    every message (measured on the running job)."""
    return replace(
        workload,
        chunk_overhead_s=overhead_s,
        encoder_overhead_s=overhead_s,
        message_latency_s=latency_s,
    )


def fitted_latency(
    schedule: Schedule, workload: Workload, overhead_s: float, measured_s: float
) -> float:
    """The per-message latency at which the simulated `schedule` (with `overhead_s` before
    each action) takes the `measured_s` it measured; 0 where it is predicted slower already.
    The plan candidates' calibration before the latency was measured, kept as its ablation:
    it charges whatever the model misses per message.
    Step time grows monotonically with latency, so bisection finds it."""

    def step(latency: float) -> float:
        return simulate(schedule, calibrated(workload, overhead_s, latency)).step_time_s

    if step(0.0) >= measured_s:
        return 0.0
    lo, hi = 0.0, measured_s / max(len(schedule.ranks[0]), 1)
    while step(hi) < measured_s and hi < measured_s:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < measured_s else (lo, mid)
    return (lo + hi) / 2

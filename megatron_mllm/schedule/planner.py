"""Optimus model planner: enumerate colocated encoder plans, drop those over memory, search the
micro-batch splits and warm-up variants with the bubble scheduler, keep the fastest."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from megatron_mllm.errors import ConfigError
from megatron_mllm.parallel.plans import ParallelPlan, enumerate_encoder_plans
from megatron_mllm.schedule.baselines import balanced_schedule, megatron_schedule
from megatron_mllm.schedule.blocks import JobCosts, state_bytes
from megatron_mllm.schedule.bubble_scheduler import (
    OptimusOptions,
    backbone_alone_seconds,
    backbone_step_seconds,
    encoder_dp_seconds,
    encoder_layouts,
    optimus_schedule,
)
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import SimResult, simulate
from megatron_mllm.schedule.validator import validate
from megatron_mllm.schedule.workload import Workload


@dataclass
class Planned:
    """A validated schedule, its costs and its simulation."""

    name: str
    schedule: Schedule
    workload: Workload
    result: SimResult
    options: OptimusOptions | None = None


@dataclass
class PlanReport:
    megatron: Planned
    balanced: Planned
    optimus: Planned
    candidates: list[tuple[OptimusOptions, float, float]] = field(default_factory=list)
    dropped: list[tuple[ParallelPlan, float]] = field(default_factory=list)  # plan, GB needed
    planner_seconds: float = 0.0
    backbone_alone_s: float = float("nan")  # the backbone with no encoder work: a lower bound

    @property
    def schedules(self) -> dict[str, Planned]:
        return {"megatron": self.megatron, "balanced": self.balanced, "optimus": self.optimus}


def run(
    name: str,
    built: tuple[Schedule, Workload],
    options: OptimusOptions | None = None,
    check: bool = True,
) -> Planned:
    """Validate (unless `check` is False) and simulate one schedule."""
    schedule, workload = built
    if check:
        validate(schedule)
    return Planned(name, schedule, workload, simulate(schedule, workload, False), options)


def model_state_gb(costs: JobCosts, enc_plan: ParallelPlan) -> float:
    """Largest per-GPU model-state estimate under `enc_plan` (backbone stage + encoder stage)."""
    job, plan = costs.job, costs.job.plan
    layer = costs.backbone_layer(plan.tp)
    per_stage = -(-job.backbone.num_layers // plan.pp)
    backbone = state_bytes(layer, plan.dp) * per_stage + state_bytes(costs.head(plan.tp), plan.dp)
    layouts, _ = encoder_layouts(costs, enc_plan)
    encoder = sum(max(state_bytes(b, enc_plan.dp) for b in lay.stages) for lay in layouts)
    return (backbone + encoder) / 1e9


def _no_plan_fits(dropped: list[tuple[ParallelPlan, float]], memory: float) -> ConfigError:
    plan, need = min(dropped, key=lambda x: x[1])
    return ConfigError(
        f"no encoder plan fits in {memory:.0f} GB per GPU: the smallest needs {need:.0f} GB "
        f"of model states ({plan}); use more GPUs, a larger TP or PP, or a GPU with more memory"
    )


def plan_optimus(
    costs: JobCosts,
    encoder_plan: ParallelPlan | None = None,
    refine: int = 1,
    wgrad_split: bool = False,
    backbone_wgrad_split: bool = False,
) -> tuple[Planned, list, list]:
    """Search encoder plans (or just `encoder_plan`) and return the best Optimus schedule;
    with `wgrad_split` the best one's split-backward variant too, with `backbone_wgrad_split`
    then the best one's with the backbone's backward split (each kept where faster)."""
    job = costs.job
    memory = job.hw.memory_gb
    plans = (
        [encoder_plan]
        if encoder_plan
        else enumerate_encoder_plans(job.plan, min(e.num_layers for e in job.encoders))
    )
    fitting, dropped = [], []
    for p in plans:
        need = model_state_gb(costs, p)
        (fitting if need < memory else dropped).append((p, need))
    if not fitting and encoder_plan is not None:
        raise _no_plan_fits(dropped, memory)
    candidates: list[tuple[OptimusOptions, float, float]] = []
    best: Planned | None = None
    cache: dict = {}
    pruned: list[ParallelPlan] = []
    if encoder_plan is None:
        # The Megatron placement is a candidate too: with few micro-batches or a small encoder,
        # replicating the encoder (its gradient all-reduce, its transfers) can cost more than
        # the bubbles it fills, and then the planner keeps the encoder on stage 0.
        stage0 = OptimusOptions(ParallelPlan(job.plan.dp, job.plan.tp, 1), placement="stage0")
        fallback = run("optimus", megatron_schedule(costs), stage0)
        candidates.append((stage0, fallback.result.step_time_s, fallback.result.peak_memory_gb))
        if fallback.result.peak_memory_gb <= memory:
            best = fallback

    def consider(opts: OptimusOptions) -> None:
        nonlocal best
        # Candidates are only simulated (which fails loudly on a missing dependency or a
        # deadlock); the one we keep is validated below.
        planned = run("optimus", optimus_schedule(costs, opts, cache), opts, check=False)
        peak = planned.result.peak_memory_gb
        candidates.append((opts, planned.result.step_time_s, peak))
        if peak > memory:
            return
        if best is None or planned.result.step_time_s < best.result.step_time_s - 1e-12:
            best = planned

    # Cheapest encoder data-parallel traffic first; a plan whose bound (backbone alone plus
    # its encoder AG/RS) cannot beat the best so far is skipped.
    bounds = sorted((encoder_dp_seconds(costs, p), i, p) for i, (p, _) in enumerate(fitting))
    for extra, _, p in bounds:
        if (
            best is not None
            and cache
            and backbone_step_seconds(cache) + extra >= best.result.step_time_s
        ):
            pruned.append(p)
            continue
        consider(OptimusOptions(p, split="even"))
    # Refine the most promising plans: the other split, the coarse schedule alone (a fine
    # schedule is kept only where it beats the coarse one), one more warm-up micro-batch.
    ranked = sorted(
        {c[0].encoder_plan: c[1] for c in candidates if c[0].placement == "colocated"}.items(),
        key=lambda x: x[1],
    )
    for p, _ in ranked[:refine]:
        variants = [OptimusOptions(p, split="greedy"), OptimusOptions(p, split="even", fine=False)]
        if job.plan.vpp == 1:
            variants.append(OptimusOptions(p, split="even", extra_warmup=1))
        for v in variants:
            consider(v)
    if wgrad_split and best is not None and best.options.placement == "colocated":
        consider(replace(best.options, wgrad_split=True))
    if backbone_wgrad_split and best is not None and splits_backbone(job, best.options):
        consider(replace(best.options, backbone_wgrad_split=True))
    if best is None:
        if not fitting:
            raise _no_plan_fits(dropped, memory)
        lowest = min(candidates, key=lambda c: c[2])
        raise ConfigError(
            f"no Optimus schedule fits in {memory:.0f} GB per GPU: the lowest peak is "
            f"{lowest[2]:.0f} GB ({lowest[0].encoder_plan}); use more GPUs, a smaller "
            f"micro-batch or a GPU with more memory"
        )
    validate(best.schedule)
    return best, candidates, dropped


def splits_backbone(job, opts: OptimusOptions) -> bool:
    """Whether a split backbone backward can go with `opts` (`backbone_wgrad`: TP 1, PP > 1,
    no virtual stages, the encoder colocated, no full recomputation)."""
    colocated = opts.placement == "colocated" and opts.encoder_plan.tp == job.plan.tp
    # With full recomputation the held products would be what recomputing frees (the cost
    # model counts a recomputed layer's input only).
    full = job.recompute.granularity == "full"
    return colocated and not full and job.plan.tp == 1 and job.plan.vpp == 1 and job.plan.pp > 1


def plan_all(
    job_costs: JobCosts,
    encoder_plan: ParallelPlan | None = None,
    wgrad_split: bool = False,
    backbone_wgrad_split: bool = False,
) -> PlanReport:
    """The three schedules for one job, simulated side by side."""
    t0 = time.process_time()
    splits = dict(wgrad_split=wgrad_split, backbone_wgrad_split=backbone_wgrad_split)
    optimus, candidates, dropped = plan_optimus(job_costs, encoder_plan, **splits)
    planner_seconds = time.process_time() - t0
    return PlanReport(
        megatron=run("megatron", megatron_schedule(job_costs)),
        balanced=run("balanced", balanced_schedule(job_costs)),
        optimus=optimus,
        candidates=candidates,
        dropped=dropped,
        planner_seconds=planner_seconds,
        backbone_alone_s=backbone_alone_seconds(job_costs),
    )

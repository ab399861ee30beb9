"""Schedules for the runtime's MLLM, planned by the schedule core at layer granularity."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.baselines import megatron_schedule
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.bubble_scheduler import OptimusOptions, optimus_schedule
from megatron_mllm.schedule.config import NO_RECOMPUTE, MLLMJob, Recompute
from megatron_mllm.schedule.hardware import HardwareProfile
from megatron_mllm.schedule.planner import plan_optimus
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.validator import validate
from megatron_mllm.schedule.workload import Workload

if TYPE_CHECKING:
    from megatron_mllm.runtime.job import RuntimeJob

# One CPU core in fp32, over gloo on loopback: only the ratios matter for planning, and measured
# unit times (see tools/bench_runtime.py) replace these where given.
CPU = HardwareProfile(
    "cpu",
    peak_tflops=0.05,
    hbm_gbps=10.0,
    nvlink_gbps=2.0,
    internode_gbps=2.0,
    memory_gb=24.0,
    gpus_per_node=64,
    efficiency=1.0,
    latency_s=50e-6,
)


def job_of(
    cfg: MLLMConfig,
    plan: ParallelPlan,
    micro_batch: int,
    num_microbatches: int,
    frozen_encoder: bool = False,
    sequence_parallel: bool = False,
    recompute: Recompute = NO_RECOMPUTE,
    images_per_sample: float = 1.0,
    backbone_split: tuple[int, ...] = (),
) -> MLLMJob:
    """The schedule core's job for the runtime's model (for planning and simulation)."""
    llm = cfg.transformer_specs()[1]
    return MLLMJob(
        cfg.encoder_specs(),
        llm,
        plan.world_size,
        plan.tp,
        plan.pp,
        vpp=plan.vpp,
        global_batch=num_microbatches * micro_batch * plan.dp,
        micro_batch=micro_batch,
        seq_len=cfg.seq_len,
        hw=CPU,
        sequence_parallel=sequence_parallel and plan.tp > 1,
        frozen_encoders=frozen_encoder,
        recompute=recompute,
        images_per_sample=images_per_sample,
        backbone_split=backbone_split,
    )


def runtime_schedule(*args, **kwargs) -> Schedule:
    """The schedule of `runtime_plan(...)` alone."""
    return runtime_plan(*args, **kwargs)[0]


def runtime_plan(
    cfg: MLLMConfig,
    plan: ParallelPlan,
    micro_batch: int,
    num_microbatches: int,
    name: str,
    encoder_plan: ParallelPlan | None = None,
    measured: dict | None = None,
    frozen_encoder: bool = False,
    unit: str = "layer",
    sequence_parallel: bool = False,
    recompute: Recompute = NO_RECOMPUTE,
    images_per_sample: float = 1.0,
    backbone_split: tuple[int, ...] = (),
    **options,
) -> tuple[Schedule, Workload]:
    """A validated schedule and its costs for the runtime's model at layer (or, with
    unit="kernel", kernel) granularity:
    "megatron" (encoder on stage 0, 1F1B, even layer split), "balanced" (the same with the
    balancing first-stage split) or "optimus" (planned, or with `encoder_plan` forced).
    `sequence_parallel`: the backbone's TP collectives are reduce-scatters and all-gathers;
    `recompute`: recomputed layers cost a second forward and keep only their input;
    `images_per_sample`: the encoders' average load (conversation data); `backbone_split`:
    layers per stage when the user fixed them (else each schedule chooses)."""
    job = job_of(
        cfg,
        plan,
        micro_batch,
        num_microbatches,
        frozen_encoder,
        sequence_parallel,
        recompute,
        images_per_sample,
        backbone_split,
    )
    return plan_job(job, name, encoder_plan, measured, unit, **options)


def plan_job(
    job: MLLMJob,
    name: str,
    encoder_plan: ParallelPlan | None = None,
    measured: dict | None = None,
    unit: str = "layer",
    **options,
) -> tuple[Schedule, Workload]:
    """`runtime_plan` for a planning job built already (`job_of`, `planning_job`)."""
    costs = JobCosts(job, measured, unit=unit)
    if name not in ("megatron", "balanced", "optimus"):
        raise ConfigError(f"unknown schedule {name!r}; use megatron, balanced or optimus")
    if name in ("megatron", "balanced"):
        # megatron: Megatron's default even layer split; balanced: the first stage, which also
        # runs the encoder, gets fewer backbone layers.
        built = megatron_schedule(costs, even_split=name == "megatron")
        if options.get("backbone_wgrad_split"):  # kept where predicted faster, if it fits
            split = megatron_schedule(costs, name == "megatron", backbone_wgrad_split=True)
            result, base = simulate(*split), simulate(*built)
            fits = result.peak_memory_gb <= costs.job.hw.memory_gb
            built = split if fits and result.step_time_s < base.step_time_s else built
    elif encoder_plan is not None:
        built = optimus_schedule(costs, OptimusOptions(encoder_plan, **options))
    else:
        best, _, _ = plan_optimus(costs, **options)
        built = best.schedule, best.workload
    validate(built[0])
    return built


def planning_job(job: RuntimeJob, num_microbatches: int | None = None) -> MLLMJob:
    """The schedule core's job for a running RuntimeJob, built in this one place for every
    planner that works on it (optimus-adaptive, re-planning, the plan candidates): its model,
    plans, recomputation and encoder load, and the backbone split its schedule built."""
    split = tuple(job.schedule.meta.backbone_layers) if job.backbone.vpp == 1 else ()
    return job_of(
        job.cfg,
        job.backbone,
        job.micro_batch,
        num_microbatches or job.num_microbatches,
        job.model.frozen_encoder,
        job.plans.sequence_parallel,
        job.model.recompute,
        job.executor.images_per_sample,
        split,
    )


def pool_plan(
    step: Schedule,
    cfg: MLLMConfig,
    plan: ParallelPlan,
    micro_batch: int,
    num_microbatches: int,
    unit: str = "layer",
    **options,
) -> tuple[Schedule, Workload]:
    """A coreset pool's schedule (and costs) of `num_microbatches` for the modules `step`'s
    job built: its encoder plan and placement, its backbone split (`options`: runtime_plan's,
    e.g. frozen_encoder, measured)."""
    from megatron_mllm.runtime.job import encoder_plan_of

    enc_plan, stage0 = encoder_plan_of(step, plan)
    layers = tuple(step.meta.backbone_layers) if plan.vpp == 1 else ()
    return runtime_plan(
        cfg,
        plan,
        micro_batch,
        num_microbatches,
        "megatron" if stage0 else "optimus",
        encoder_plan=None if stage0 else enc_plan,
        unit="layer" if stage0 else unit,
        backbone_split=layers,
        **options,
    )


def adaptive_planner(job: RuntimeJob):
    """The per-step planner (optimus-adaptive) around a RuntimeJob's static Optimus schedule
    (planned from `job.executor.plan_times`, if it was), in whole-micro-batch mode with every
    micro-batch keeping its encoder actions (a text-only one passes empty messages). None
    where the schedule is not a colocated Optimus plan."""
    from megatron_mllm.schedule.adaptive import AdaptivePlanner
    from megatron_mllm.schedule.planner import run

    schedule, opts = job.schedule, job.schedule.origin
    if schedule.meta.encoder_on_stage0 or opts is None:
        return None
    costs = JobCosts(planning_job(job), job.executor.plan_times, unit=job.plans.encoder_units)
    opts = OptimusOptions(opts.encoder_plan, opts.split, opts.extra_warmup, opts.fine)
    static = run("optimus", optimus_schedule(costs, opts), opts)
    if static.schedule.ranks != schedule.ranks:
        return None  # planned from other costs (measured times): nothing to re-plan from
    return AdaptivePlanner(
        costs,
        static,
        job.executor.images_per_sample,
        skip_text_only=False,
        whole_micro_batches=True,
    )

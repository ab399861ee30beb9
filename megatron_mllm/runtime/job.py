"""What a runtime job is (`RuntimeJob`: typed parts for the model, the plans, the data, the
optimizer, the executor's knobs, what to collect and test-only fault hooks) and every check of it
that must pass before any process group exists (`check_job`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.parallel.plans import ParallelPlan, encoder_stage_placement
from megatron_mllm.schedule.config import Recompute
from megatron_mllm.schedule.schedule import Schedule

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelParts:
    """What trains: the model, its canonical weights (a dict, or a file written by
    `models.weights.save_full_state` that each rank maps) and whether the encoder is frozen."""

    cfg: MLLMConfig
    weights: dict[str, torch.Tensor] | str
    frozen_encoder: bool = False
    precision: str = "fp32"  # fp32, bf16 or fp16 (parameters, activations, messages; fp32 main
    # parameters in the distributed optimizer; fp16 with megatron-core's dynamic loss scaling)
    recompute: Recompute = Recompute()  # activation recomputation (Megatron's --recompute-*)
    transformer_impl: str = "local"  # megatron-core's layer specs: local, or transformer_engine

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]


@dataclass(frozen=True)
class PlanParts:
    """How it is split: the backbone's plan and the schedule (its metadata names the encoder
    placement), the encoder's unit size in that schedule, sequence parallelism, and the
    megatron-core baseline's uneven first stage."""

    backbone: ParallelPlan
    schedule: Schedule | None = None  # executor mode
    encoder_units: str = "layer"  # the schedule's encoder granularity: "layer" or "kernel"
    sequence_parallel: bool = False  # the backbone's activations split over TP (TP > 1 only)
    backbone_first_stage_layers: int | None = None  # megatron_core mode: uneven first stage


@dataclass(frozen=True)
class DataParts:
    """What each step trains on: micro-batches per DP replica, from a LLaVA-format energon
    dataset or synthetic; with a coreset, B chosen from a pool of r x B (its own forward-only
    schedule)."""

    micro_batch: int
    num_microbatches: int
    llava: object = None  # a data.llava_source.LlavaData (else synthetic image-caption pairs)
    seed: int = 0
    coreset: object = None  # a CoresetConfig
    pool_schedule: Schedule | None = None
    # Look-ahead (--coreset-lookahead): the step's schedule with the next step's pool going
    # forward in its bubbles (`schedule/lookahead.py`); selection then uses the step's weights.
    lookahead_schedule: Schedule | None = None
    # How the merge is made (--coreset-lookahead-order), again on a re-plan's measured times.
    lookahead_order: str = "simulated"
    # Megatron's --calculate-per-token-loss: every labelled token of the global batch weighs
    # the same (each micro-batch's loss sum over the global batch's labelled-token count).
    per_token_loss: bool = False
    # optimus-adaptive's sample assignment at run time: each replica's samples dealt into
    # micro-batches of equal image counts (runtime/inputs/batches.py); needs per_token_loss.
    balance_samples: bool = False


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 0.0  # > 0: an Adam step per step (megatron-core's FP32Optimizer, or below)
    clip_grad: float = 1.0
    min_lr: float = 0.0  # the schedule's floor (megatron-core's optimizers keep it per group)
    overlap_grad_reduce: bool = False  # DDP buckets reduced as their last backward finishes
    distributed: bool = False  # megatron-core's DistributedOptimizer (state sharded over DP)
    ddp_bucket_size: int | None = None  # parameters per DDP bucket (megatron-core's default)
    overlap_param_gather: bool = False  # the AG action starts the all-gather, first use waits
    grad_reduce_in_fp32: bool = False  # --accumulate-allreduce-grads-in-fp32 (else: param dtype)
    initial_loss_scale: float = 2.0**32  # fp16: the dynamic loss scale's start (Megatron's)
    # A step whose loss or gradient norm is NaN or Inf is skipped (--check-for-nan-in-loss-and-
    # grad); off: applied, as megatron-core's bf16/fp32 optimizers apply it.
    check_nan: bool = True


@dataclass(frozen=True)
class ExecutorSettings:
    """Our executor's knobs (see executor.py and messages.py)."""

    dynamic: bool = False  # run ready encoder work while waiting for messages
    ordered_p2p: bool = False  # match messages by posting order, as NCCL does (on with NCCL)
    overlap_tp_fills: bool = False  # TP-bubble fills during the backbone's TP collectives
    replan_after: int | None = None  # re-plan from measured unit times after this many steps
    # Receives posted ahead of the one needed: per sender when ordered, of the program when tagged;
    # None: 2 per sender when ordered, every one of the program when tagged (messages.py)
    recv_lookahead: int | None = None
    max_encoder_ahead: int = 2  # dynamic mode: encoder micro-batches run ahead at most
    # optimus-adaptive: each step's own plan, made one step ahead
    # (runtime/planning/step_plans.py), for encoder costs of this many images per sample
    adaptive: bool = False
    images_per_sample: float = 1.0
    plan_times: dict | None = None  # measured unit times the static plan was made from
    # False: the next step is planned in a background thread while this one runs; True: at the
    # start of the step, on its own path (an ablation: a thread competes for a rank's core)
    plan_in_step: bool = False


@dataclass(frozen=True)
class Collect:
    """What the result carries beyond losses and times (step 0's gradient shards, the final
    parameter shards, measured memory: runtime/assembly/memory.py)."""

    grads: bool = True
    params: bool = False
    memory: bool = False


@dataclass(frozen=True)
class FaultHooks:
    """Test-only fault injection: `fail_rank` exits mid-step, before its program's op
    `fail_at_op`; in the steps `nan_loss_steps` every loss is scaled by NaN before its
    backward (its gradients become NaN, the logged loss stays what it was)."""

    fail_rank: int | None = None
    fail_at_op: int = 0
    nan_loss_steps: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RuntimeJob:
    """One runtime job: its typed parts, the run mode and how long it runs."""

    model: ModelParts
    plans: PlanParts
    data: DataParts
    mode: str = "executor"  # "executor", "megatron_core" or "reference"
    steps: int = 1
    timeout_s: float = 60.0
    optimizer: OptimizerSettings = OptimizerSettings()
    executor: ExecutorSettings = ExecutorSettings()
    collect: Collect = Collect()
    faults: FaultHooks = FaultHooks()

    # Views of the parts read most often.
    @property
    def cfg(self) -> MLLMConfig:
        return self.model.cfg

    @property
    def backbone(self) -> ParallelPlan:
        return self.plans.backbone

    @property
    def schedule(self) -> Schedule | None:
        return self.plans.schedule

    @property
    def micro_batch(self) -> int:
        return self.data.micro_batch

    @property
    def num_microbatches(self) -> int:
        return self.data.num_microbatches


def layer_overrides(layers: tuple[int, ...] | list[int], pp: int) -> dict:
    """TransformerConfig fields for an uneven first/last stage (Megatron's own knobs)."""
    if not layers or pp == 1 or len(set(layers)) == 1:
        return {}
    out = {"num_layers_in_first_pipeline_stage": layers[0]}
    if pp > 2:
        out["num_layers_in_last_pipeline_stage"] = layers[-1]
    return out


def encoder_plan_of(schedule: Schedule, backbone: ParallelPlan) -> tuple[ParallelPlan, bool]:
    """The schedule's encoder plan, and whether the encoders sit whole on backbone stage 0
    (Megatron's placement; with one backbone stage that is the colocated plan DP x TP x 1).
    Read from the schedule's metadata; inferred from its encoder layout for schedules saved
    without it. Either way it must agree with the layout and colocate with `backbone`."""
    meta = schedule.meta
    if not meta.encoders:
        raise ConfigError("the runtime needs a schedule with the encoder as its own actions")
    enc = meta.encoders[0]
    stages, pipes = enc.num_stages, enc.num_pipes
    tp_e = backbone.tp // meta.slots
    stage0 = pipes * stages == 1 and meta.slots == 1 and backbone.pp > 1
    if meta.encoder_plan and meta.encoder_on_stage0 != stage0 and backbone.pp > 1:
        raise ConfigError("schedule's encoder_on_stage0 disagrees with its encoder layout")
    if stage0:
        return ParallelPlan(backbone.dp, backbone.tp, 1), True
    if pipes != (backbone.pp // stages) * meta.slots:
        raise ConfigError(
            f"schedule's encoder layout ({pipes} pipelines x {stages} stages) does "
            f"not colocate with backbone {backbone}"
        )
    plan = ParallelPlan(backbone.world_size // (tp_e * stages), tp_e, stages)
    if meta.encoder_plan and tuple(meta.encoder_plan) != (plan.dp, plan.tp, plan.pp):
        raise ConfigError(
            f"schedule's encoder plan DP{meta.encoder_plan[0]} TP{meta.encoder_plan[1]} "
            f"PP{meta.encoder_plan[2]} disagrees with its layout on backbone {backbone} ({plan})"
        )
    for order in (plan, replace(plan, reversed_stages=True)):
        if all(e.placement == encoder_stage_placement(backbone, order) for e in meta.encoders):
            return order, False
    raise ConfigError(
        f"schedule's encoder stages sit on backbone stages {[s for s, _ in enc.placement[0]]}: "
        f"the runtime places {plan} first stage first or last stage first"
    )


def check_job(job: RuntimeJob, world: int) -> None:
    """Every configuration error, before any process group exists."""
    if job.mode not in ("executor", "megatron_core", "reference"):
        raise ConfigError(f"unknown mode {job.mode!r}; use executor, megatron_core or reference")
    if job.mode != "reference" and job.backbone.world_size != world:
        raise ConfigError(
            f"plan {job.backbone} needs {job.backbone.world_size} ranks; "
            f"the job was started with {world}"
        )
    job.cfg.validate(job.backbone.tp, sequence_parallel=job.plans.sequence_parallel)
    if (
        job.mode == "megatron_core"
        and job.data.llava is not None
        and job.optimizer.overlap_grad_reduce
    ):
        raise ConfigError(
            "megatron-core's own schedule with overlapped reductions expects every step's last "
            "micro-batch to reach the encoder; a text-only one does not: drop the overlap"
        )
    _check_backbone_split(job)
    if (
        job.schedule is not None
        and job.schedule.meta.splits_weight_grads
        and job.model.transformer_impl != "local"
    ):
        raise ConfigError(
            f"a split encoder backward (EW actions) defers megatron-core's local linears' "
            f"weight gradients; --transformer-impl {job.model.transformer_impl} has none: use "
            f"--transformer-impl local or plan without --encoder-wgrad-split"
        )
    _check_backbone_wgrad_split(job)
    if job.model.transformer_impl == "transformer_engine":
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "transformer_engine layers need Transformer Engine, which is not installed "
                "here; use the local layers"
            )
        if job.plans.encoder_units == "kernel":
            raise ConfigError(
                "kernel-sized encoder units are cut from megatron-core's local layers; use layer "
                "units with transformer_engine"
            )
    low = job.model.precision != "fp32"
    if job.model.precision not in PRECISIONS:
        raise ConfigError(f"precision {job.model.precision!r}: use one of {', '.join(PRECISIONS)}")
    if low and (job.mode == "reference" or not job.optimizer.distributed):
        raise ConfigError(
            f"{job.model.precision} runs with the distributed optimizer for now (its fp32 main "
            "parameters; not in the one-process reference); add --use-distributed-optimizer"
        )
    if job.optimizer.overlap_param_gather and not job.optimizer.distributed:
        raise ConfigError(
            "overlapped parameter all-gather needs the distributed optimizer (without it the "
            "parameters are never sharded); add --use-distributed-optimizer"
        )
    if job.mode == "megatron_core" and job.cfg.num_encoders > 1:
        raise ConfigError("the megatron-core baseline runs one encoder; use the executor")
    _check_per_token(job)
    if job.mode != "executor":
        return
    if job.schedule is None:
        raise ConfigError("executor mode needs a schedule")
    _check_schedule_shape(job)
    enc_plan = _check_encoder_layers(job)
    _check_coreset(job)
    _check_lookahead(job)
    _check_encoder_units(job, enc_plan)


def _check_schedule_shape(job: RuntimeJob) -> None:
    """The schedule is for this job's pipeline, micro-batches, layers and encoders."""
    meta = job.schedule.meta
    if meta.pp != job.backbone.pp or meta.num_microbatches != job.num_microbatches:
        raise ConfigError(
            f"schedule is for PP {meta.pp} x {meta.num_microbatches} micro-batches;"
            f" the job has PP {job.backbone.pp} x {job.num_microbatches}"
        )
    if meta.vpp != job.backbone.vpp:
        raise ConfigError(
            f"schedule is for VPP {meta.vpp}; the job's backbone plan has VPP {job.backbone.vpp}"
        )
    if meta.vpp > 1 and len(set(meta.backbone_layers)) > 1:
        raise ConfigError(
            f"an interleaved backbone needs an even layer split; the schedule has "
            f"{list(meta.backbone_layers)} (use the megatron or optimus schedule)"
        )
    if meta.backbone_layers and sum(meta.backbone_layers) != job.cfg.llm_layers:
        raise ConfigError(
            f"schedule splits {sum(meta.backbone_layers)} backbone layers; the "
            f"model has {job.cfg.llm_layers}"
        )
    if len(meta.encoders) != job.cfg.num_encoders:
        raise ConfigError(
            f"schedule has {len(meta.encoders)} encoder(s); the model has {job.cfg.num_encoders}"
        )
    if meta.text_only:
        raise ConfigError(
            "the schedule drops text-only micro-batches' encoder actions: the simulator's, not "
            "the executor's (the runtime's per-step plans keep every action)"
        )


def _check_encoder_layers(job: RuntimeJob) -> ParallelPlan:
    """Every encoder's layers split over the encoder plan; returns that plan."""
    enc_plan, _ = encoder_plan_of(job.schedule, job.backbone)
    job.cfg.validate(job.backbone.tp, enc_plan.tp)
    for e in range(job.cfg.num_encoders):
        layers = job.cfg.encoder_config(e).vit_layers
        if layers % enc_plan.pp:
            raise ConfigError(
                f"encoder {e}'s {layers} layers do not split evenly over encoder PP {enc_plan.pp}"
            )
    return enc_plan


def _check_coreset(job: RuntimeJob) -> None:
    """A coreset's batch is the step's samples and its pool has a schedule."""
    if job.data.coreset is not None:
        size = job.data.coreset.pool_size
        if job.data.coreset.batch_size != job.num_microbatches * job.micro_batch:
            raise ConfigError(
                f"coreset batch {job.data.coreset.batch_size} must equal the step's "
                f"{job.num_microbatches} x {job.micro_batch} samples"
            )
        if (
            size % job.micro_batch
            or job.data.pool_schedule is None
            or job.data.pool_schedule.meta.num_microbatches != size // job.micro_batch
        ):
            raise ConfigError(
                f"the coreset pool of {size} needs a pool schedule of "
                f"{size // job.micro_batch} micro-batches of {job.micro_batch}"
            )


def _check_encoder_units(job: RuntimeJob, enc_plan: ParallelPlan) -> None:
    """The schedule's encoder units are this model's at the job's granularity, frozen or
    trained as the job is."""
    meta = job.schedule.meta
    if job.plans.encoder_units not in ("layer", "kernel"):
        raise ConfigError(f"encoder units {job.plans.encoder_units!r}: use 'layer' or 'kernel'")
    per_layer, tail = (8, 2) if job.plans.encoder_units == "kernel" else (1, 1)
    for e, enc in enumerate(meta.encoders):
        frozen_schedule = not any(enc.bwd_kernels[:-1]) and enc.bwd_kernels[-1] == tail
        if job.model.frozen_encoder != frozen_schedule:
            raise ConfigError(
                "the encoder is frozen but the schedule trains it; plan with frozen_encoder=True"
                if job.model.frozen_encoder
                else "the schedule is planned for a frozen encoder but this job trains it"
            )
        layers = job.cfg.encoder_config(e).vit_layers // enc_plan.pp
        for j in range(enc.num_stages):
            units = (j == 0) + per_layer * layers + tail * (j == enc.num_stages - 1)
            if enc.fwd_kernels[j] != units:
                raise ConfigError(
                    f"schedule's encoder {e} stage {j} has {enc.fwd_kernels[j]} units; this "
                    f"model's has {units} at {job.plans.encoder_units} granularity (plan with "
                    f"unit='{job.plans.encoder_units}')"
                )


def _check_backbone_wgrad_split(job: RuntimeJob) -> None:
    """A split backbone backward (W actions) defers megatron-core's local linears' weight
    gradients, which sequence parallelism and Transformer Engine do not allow."""
    if job.schedule is None or not job.schedule.meta.backbone_wgrad:
        return
    if job.backbone.tp > 1:
        raise ConfigError(
            f"a split backbone backward (W actions) runs at backbone TP 1 (got {job.backbone}); "
            "plan without --backbone-wgrad-split"
        )
    if job.model.transformer_impl != "local" or job.plans.sequence_parallel:
        given = (
            "--sequence-parallel"
            if job.plans.sequence_parallel
            else f"--transformer-impl {job.model.transformer_impl}"
        )
        raise ConfigError(
            f"a split backbone backward (W actions) defers megatron-core's local linears' "
            f"weight gradients, which {given} does not allow: use --transformer-impl local "
            "without sequence parallelism or plan without --backbone-wgrad-split"
        )


def _check_backbone_split(job: RuntimeJob) -> None:
    """The backbone's layers per stage must be what megatron-core can build: an even split, or
    (its first/last-stage knobs) equal middle stages with the first and last taking the rest,
    as the planner's uneven splits are (10 layers on PP 4: 2/3/3/2)."""
    pp, layers = job.backbone.pp, job.cfg.llm_layers
    if job.mode == "megatron_core" and job.plans.backbone_first_stage_layers is not None:
        first = job.plans.backbone_first_stage_layers
        if pp > 1 and (layers - first) % (pp - 1):
            raise ConfigError(
                f"{layers - first} backbone layers after a first stage of {first} do not split "
                f"evenly over the other {pp - 1} stages"
            )
        return
    split = job.schedule.meta.backbone_layers if job.mode == "executor" and job.schedule else ()
    if not split or job.backbone.vpp > 1:
        if layers % pp:
            raise ConfigError(f"{layers} backbone layers do not split evenly over PP {pp}")
        return
    if len(split) != pp:
        return  # a schedule for another PP: refused below, naming both
    if len(set(split[1:-1])) > 1:
        raise ConfigError(
            f"the schedule's backbone split {list(split)} is not one megatron-core builds on PP "
            f"{pp}: its middle stages must hold equal layer counts"
        )


def _check_per_token(job: RuntimeJob) -> None:
    if job.data.balance_samples and not job.data.per_token_loss:
        raise ConfigError(
            "moving samples between micro-batches changes the gradient of a per-micro-batch "
            "mean loss; balance samples only with a per-token loss (--calculate-per-token-loss)"
        )
    if job.data.balance_samples and job.mode == "megatron_core":
        raise ConfigError(
            "samples are dealt by images on our executor's schedules (and the reference), not "
            "on megatron-core's own schedule; use another --bubble-schedule"
        )
    if job.data.balance_samples and job.data.coreset is not None:
        raise ConfigError(
            "balancing samples by images applies to the loader's batches, not a coreset's "
            "chosen rows; drop one of the two"
        )


def _check_lookahead(job: RuntimeJob) -> None:
    """A look-ahead schedule is the job's step with its coreset pool's micro-batches."""
    ahead = job.data.lookahead_schedule
    if ahead is None:
        return
    pool = job.data.pool_schedule
    if job.data.coreset is None or pool is None:
        raise ConfigError("coreset look-ahead needs a coreset (--coreset-pool-ratio)")
    meta = ahead.meta
    if (meta.num_microbatches, meta.lookahead) != (
        job.num_microbatches,
        pool.meta.num_microbatches,
    ):
        raise ConfigError(
            f"the look-ahead schedule has {meta.num_microbatches} + {meta.lookahead} "
            f"micro-batches; the job needs {job.num_microbatches} + {pool.meta.num_microbatches}"
        )
    if job.executor.adaptive:
        raise ConfigError(
            "coreset look-ahead runs one merged schedule (made again only on a re-plan): drop "
            "optimus-adaptive"
        )

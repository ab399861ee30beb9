"""The run pretrain_mllm.py's checked arguments describe, typed and built once (`RunConfig`):
the model, both parallel plans, the batches, the schedule choice and what the planner plans for.
Every entry point that trains (pretrain_mllm.py, the runtime benchmarks) builds its jobs from it;
`parse_run` is the one way from a command line to it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.parallel.plans import ParallelPlan, colocated_encoder_plan
from megatron_mllm.schedule.choice import ScheduleChoice
from megatron_mllm.schedule.config import MLLMJob, Recompute

if TYPE_CHECKING:
    from megatron_mllm.runtime.job import FaultHooks, RuntimeJob
    from megatron_mllm.schedule.schedule import Schedule
    from megatron_mllm.schedule.workload import Workload


@dataclass(frozen=True)
class RunConfig:
    """What a run trains and how it is split, as typed values (the arguments stay Megatron's
    namespace for everything else: logging, checkpoints, the LR schedule)."""

    args: argparse.Namespace  # checked by validate_args; read, never written
    model: MLLMConfig
    plan: ParallelPlan
    encoder_plan: ParallelPlan | None  # forced by --encoder-*-parallel-size, else planned
    micro_batch: int
    num_microbatches: int  # per step and DP replica
    schedule: ScheduleChoice
    recompute: Recompute
    images_per_sample: float  # the encoders' mean load the plan is made for

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """The run `args` (checked by `validate_args`) describe; reads the data set's image
        counts where --data-path is given, changes nothing."""
        from megatron_mllm.training.model_args import model_config

        plan = ParallelPlan(
            args.data_parallel_size,
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
        )
        forced = None
        if args.encoder_tensor_model_parallel_size:
            forced = colocated_encoder_plan(
                plan,
                args.encoder_tensor_model_parallel_size,
                args.encoder_pipeline_model_parallel_size,
            )
        model = model_config(args)
        return cls(
            args,
            model,
            plan,
            forced,
            args.micro_batch_size,
            args.global_batch_size // (args.micro_batch_size * plan.dp),
            ScheduleChoice(args.bubble_schedule),
            Recompute(
                args.recompute_granularity,
                args.recompute_method,
                args.recompute_num_layers,
                args.recompute_vision,
            ),
            encoder_load(args, model),
        )

    @property
    def precision(self) -> str:
        return "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"

    @property
    def deals_samples(self) -> bool:
        """Whether optimus-adaptive also deals each step's samples (rows: a packed row moves
        whole) into micro-batches of equal encoder loads (with a per-token loss, which keeps
        the gradient); otherwise its micro-batches keep their samples and only their slots and
        encoder work are planned."""
        return self.schedule.per_step and self.args.calculate_per_token_loss

    @property
    def fill_unit(self) -> str:
        """The encoder's unit in the static plan: --fill-granularity for Optimus, else layers."""
        return self.args.fill_granularity if self.schedule.is_optimus else "layer"

    def planning_job(self) -> MLLMJob:
        """The schedule core's job for this run (static plan and plan candidates)."""
        from megatron_mllm.runtime.planning.schedules import job_of

        a = self.args
        return job_of(
            self.model,
            self.plan,
            self.micro_batch,
            self.num_microbatches,
            a.freeze_ViT,
            a.sequence_parallel,
            self.recompute,
            self.images_per_sample,
            a.backbone_split,
        )

    def static_plan(self) -> tuple[Schedule, Workload]:
        """The validated schedule --bubble-schedule names (and its costs), planned for this run
        from the analytic cost model."""
        from megatron_mllm.runtime.planning.schedules import plan_job

        split = {"wgrad_split": True} if self.args.encoder_wgrad_split else {}
        if self.args.backbone_wgrad_split:
            split["backbone_wgrad_split"] = True
        job, name = self.planning_job(), self.schedule.planned
        return plan_job(job, name, self.encoder_plan, unit=self.fill_unit, **split)

    def runtime_job(
        self,
        schedule: Schedule | None,
        state,
        pools: tuple = (None, None),
        units: str | None = None,
        faults: FaultHooks | None = None,
    ) -> RuntimeJob:
        """The RuntimeJob of this run on `schedule` from the weights `state`; `pools`: the
        coreset pool's schedule and the look-ahead one; `units`: the encoder's unit size in
        `schedule` (default: the static plan's)."""
        from megatron_mllm.runtime.job import (
            Collect,
            ExecutorSettings,
            FaultHooks,
            ModelParts,
            PlanParts,
            RuntimeJob,
        )

        a = self.args
        return RuntimeJob(
            ModelParts(
                self.model,
                state,
                frozen_encoder=a.freeze_ViT,
                precision=self.precision,
                recompute=self.recompute,
                transformer_impl=a.transformer_impl,
            ),
            PlanParts(
                self.plan,
                schedule=schedule,
                encoder_units=units or self.fill_unit,
                sequence_parallel=a.sequence_parallel,
            ),
            self._data_parts(pools),
            optimizer=self._optimizer(),
            faults=faults or FaultHooks(),
            collect=Collect(grads=False),
            executor=ExecutorSettings(
                overlap_tp_fills=a.overlap_tp_fills,
                adaptive=self.schedule.per_step,
                images_per_sample=self.images_per_sample,
            ),
            timeout_s=a.distributed_timeout_minutes * 60,
        )

    def _data_parts(self, pools: tuple):
        from megatron_mllm.runtime.job import DataParts

        a = self.args
        return DataParts(
            self.micro_batch,
            self.num_microbatches,
            seed=a.seed,
            coreset=a.coreset,
            pool_schedule=pools[0],
            lookahead_schedule=pools[1],
            lookahead_order=a.coreset_lookahead_order or "simulated",
            llava=llava_data(a),
            per_token_loss=a.calculate_per_token_loss,
            balance_samples=self.deals_samples,
        )

    def _optimizer(self):
        from megatron_mllm.runtime.job import OptimizerSettings

        a = self.args
        return OptimizerSettings(
            lr=a.lr,
            clip_grad=a.clip_grad,
            min_lr=a.min_lr,
            overlap_grad_reduce=a.overlap_grad_reduce,
            distributed=a.use_distributed_optimizer,
            ddp_bucket_size=a.ddp_bucket_size,
            overlap_param_gather=a.overlap_param_gather,
            grad_reduce_in_fp32=a.accumulate_allreduce_grads_in_fp32,
            initial_loss_scale=a.initial_loss_scale,
            check_nan=a.check_for_nan_in_loss_and_grad,
        )


def parse_run(argv: list[str], world_size: int | None = None) -> RunConfig:
    """`argv` (pretrain_mllm.py's arguments) parsed, checked in one line on error and typed;
    `world_size`: the ranks it is checked for (default: WORLD_SIZE)."""
    from megatron_mllm.training.arguments import parse_args

    return RunConfig.from_args(parse_args(argv, world_size))


def encoder_load(args, cfg: MLLMConfig, times: dict | None = None) -> float:
    """The encoders' mean load per sample the plan is made for, in nominal images: the data
    set's images per sample (1.0 for synthetic data); for a native-resolution tower a
    micro-batch's expected cost at its images' resized sizes (`schedule.patch_loads`, profiled
    where the measured unit `times` carry the tower's profile) over as many nominal --img-h
    images', from the records' sizes the conversion sampled."""
    if cfg.vit_native:
        return _native_load(args, cfg, times)
    if not args.data_path:
        return 1.0
    from megatron_mllm.data.energon_llava import images_per_sample

    return images_per_sample(args.data_path)


def _native_load(args, cfg: MLLMConfig, times: dict | None) -> float:
    from dataclasses import replace

    from megatron_mllm.runtime.inputs.batches import tower_cost
    from megatron_mllm.schedule.patch_loads import expected_load

    shape, side, b = tower_cost(cfg, times), cfg.image_size // cfg.patch_size, args.micro_batch_size
    if not args.data_path:
        from megatron_mllm.data.synthetic import native_records

        return expected_load(shape, native_records(cfg), b, (side, side))
    from megatron_mllm.data.energon_llava import images_per_sample, record_image_sizes
    from megatron_mllm.data.native_images import smart_resize

    records = record_image_sizes(args.data_path)
    if records is None:  # converted before the sizes were recorded: nominal images
        return images_per_sample(args.data_path)
    bounds = {"min_pixels": args.min_pixels, "max_pixels": args.max_pixels}
    spec = replace(cfg.native_image_spec(), **{k: v for k, v in bounds.items() if v})
    p = cfg.patch_size
    grids = [[tuple(x // p for x in smart_resize(h, w, spec)) for h, w in r] for r in records]
    return expected_load(shape, grids, b, (side, side))


def llava_data(args):
    """The conversation data --data-path and the tokenizer arguments describe (or None)."""
    if not args.data_path:
        return None
    from megatron_mllm.data.llava_source import LlavaData

    return LlavaData(
        args.data_path,
        args.tokenizer_model,
        args.seq_length,
        image_token=args.image_token,
        loss_on_prompt=args.loss_on_prompt,
        num_workers=args.num_workers,
        clip_normalisation=args.encoder_arch == "clip",
        exclude_shards=tuple(args.data_left_out),
        sources=tuple(args.data_sources),
        packing_buffer_size=args.packing_buffer_size,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
    )

"""Our executor on one job: the rank's groups, modules and program, built once; then one
`step()` per training step (with the coreset's pool pass first when selecting), optional online
re-planning, and the run's result."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.bootstrap import nccl_messages
from megatron_mllm.runtime.assembly.model_builder import (
    BackbonePlacement,
    EncoderPlacement,
    build_job_model,
)
from megatron_mllm.runtime.engine.breakdown import StepBreakdown, breakdown_of_spans, busy_seconds
from megatron_mllm.runtime.engine.program import forward_only_program, gpu_program
from megatron_mllm.runtime.engine.step_types import PassKind
from megatron_mllm.runtime.job import RuntimeJob, check_job, encoder_plan_of, layer_overrides


class ExecutorRun:
    """Our executor on one job: built once, then `step()` as often as wanted."""

    def __init__(
        self, rank: int, world: int, job: RuntimeJob, device: torch.device, data=None
    ) -> None:
        """`data`: another run's StepData to read from (plan candidates share one stream)."""
        from megatron_mllm.parallel.groups import build_colocated_groups

        self.rank, self.job, self.device = rank, job, device
        plan = job.backbone
        enc_plan, self.stage0 = encoder_plan_of(job.schedule, plan)
        groups = build_colocated_groups(plan, plan if self.stage0 else enc_plan, world, rank)
        self.groups, c = groups, groups.coords
        self.rank_model = build_job_model(
            job.model,
            BackbonePlacement(
                groups.backbone,
                plan.tp,
                c.tp,
                plan.pp,
                c.stage,
                job.schedule.meta.vpp,
                job.plans.sequence_parallel,
                layer_overrides(job.schedule.meta.backbone_layers, plan.pp),
            ),
            self._encoder_placement(enc_plan),
            device,
        )
        self.chunks, self.encoders = self.rank_model.chunks, self.rank_model.encoders
        self.backbone = self.rank_model.backbone
        self.encoder = self.encoders[0]
        self.enc_tp = plan.tp if self.stage0 else enc_plan.tp
        self.program = gpu_program(job.schedule, groups, self.enc_tp)
        self.eval_program = forward_only_program(self.program)
        self.ordered = self.pool_ordered = self.eval_ordered = self.ahead_ordered = None
        self.pair_groups: dict[tuple[int, int], object] = {}  # kept over re-plans
        if job.executor.ordered_p2p or nccl_messages():
            self._ordered_p2p(plan, plan if self.stage0 else enc_plan)
        if job.faults.fail_rank == rank:
            self.program = self.program[: job.faults.fail_at_op]
        self.enc_dp_group = groups.backbone.dp if self.stage0 else groups.encoder.dp
        self.grad_sync = self._wrap_parts()
        self.optimizer = self._build_optimizer()
        # Clipping norm: each part once, summed over its own plan's model-parallel group.
        enc_groups = (
            (groups.backbone.mp, groups.backbone.tp)
            if self.stage0
            else (groups.encoder.mp, groups.encoder.tp)
        )
        self.parts = [
            *((chunk, groups.backbone.mp, groups.backbone.tp) for chunk in self.chunks),
            *((encoder, *enc_groups) for encoder in self.encoders),
        ]
        self.history, self.seconds, self.grads, self.spans = [], [], None, []
        self.compute_seconds: list[float] = []  # per step: time this rank computed
        self.dp_seconds: list[float] = []  # per step: time this rank waited for DP collectives
        self.breakdowns: list[StepBreakdown] = []  # per step: where the time went
        self.skipped_iterations = 0  # steps not applied (NaN or Inf; fp16: an overflow)
        self.last_loss = float("nan")  # the last step's mean loss over every replica
        self.mean_losses: list[float] = []  # every step's
        self.unit_times: dict[tuple[str, str, str], list[float]] = {}
        self.replanned = None  # (schedule, workload, measured times) once re-planned
        self.saved = None
        if job.collect.memory:
            from megatron_mllm.runtime.assembly.memory import SavedActivations

            self.saved = SavedActivations(self.rank_model.modules)
        from megatron_mllm.runtime.inputs.batches import StepData

        self.data = data if data is not None else StepData(job, [c.dp])
        if job.data.balance_samples and plan.dp > 1:  # samples dealt across the replicas
            from megatron_mllm.runtime.inputs.sample_exchange import dp_exchange_group

            self.data.exchange = dp_exchange_group(plan, rank)
        self.adaptive = (
            None  # optimus-adaptive: each step's own plan (runtime/planning/step_plans.py)
        )
        if job.executor.adaptive:
            from megatron_mllm.runtime.planning.step_plans import AdaptiveSteps

            self.adaptive = AdaptiveSteps(self)
        self.coreset = None  # the coreset sampler's steps (runtime/modes/coreset_steps.py)
        if job.data.coreset is not None:
            from megatron_mllm.runtime.modes.coreset_steps import CoresetSteps

            self.coreset = CoresetSteps(self)

    def _encoder_placement(self, enc_plan: ParallelPlan) -> EncoderPlacement | None:
        """This rank's encoder stage: whole on backbone stage 0 (Megatron's placement; other
        stages hold none), or the encoder plan's stage colocated on every rank."""
        c, plan, kernels = (
            self.groups.coords,
            self.job.backbone,
            self.job.plans.encoder_units == "kernel",
        )
        if self.stage0:
            if c.stage != 0:
                return None
            return EncoderPlacement(self.groups.stage0_encoder(), plan.tp, c.tp, 0, 1, kernels)
        pg = self.groups.encoder
        return EncoderPlacement(pg, enc_plan.tp, c.enc_tp, c.enc_stage, enc_plan.pp, kernels)

    def _build_optimizer(self):
        """megatron-core's FP32Optimizer over this rank's parameters, or with `distributed` its
        DistributedOptimizer over the DDP-wrapped parts; None without a learning rate."""
        from megatron_mllm.runtime.assembly.optimizer import (
            build_distributed_optimizer,
            build_optimizer,
        )

        opt = self.job.optimizer
        if opt.lr <= 0:
            return None
        if opt.distributed:
            dtype = self.job.model.dtype
            return build_distributed_optimizer(
                self.grad_sync,
                self.part_names,
                opt.lr,
                opt.clip_grad,
                dtype,
                min_lr=opt.min_lr,
                overlap_param_gather=opt.overlap_param_gather,
                initial_loss_scale=opt.initial_loss_scale,
            )
        return build_optimizer(self.rank_model.modules, opt.lr)

    def _wrap_parts(self) -> dict:
        """megatron-core DDP per part, on a DP group of its own (see data_parallel.py). Every
        rank creates every part's group (collective), also for parts it does not hold."""
        from megatron_mllm.runtime.assembly.data_parallel import dedicated_group, wrap_part
        from megatron_mllm.schedule.keys import part_name

        groups, opt = self.groups, self.job.optimizer
        knobs = (
            self.job.backbone.dp,
            opt.overlap_grad_reduce,
            opt.ddp_bucket_size,
            opt.distributed,
            opt.overlap_param_gather,
            opt.grad_reduce_in_fp32,
        )
        bb_dp = dedicated_group(groups.backbone.dp)
        out = {"bb": wrap_part(self.chunks, groups.backbone, bb_dp, groups.solo, *knobs)}
        pg = groups.stage0_encoder() if self.stage0 else groups.encoder
        self.part_names = ["bb"]  # every trained part of the job, held here or not
        for e, encoder in enumerate(self.encoders):
            held = encoder is not None and any(p.requires_grad for p in encoder.parameters())
            dp = dedicated_group(self.enc_dp_group if encoder is not None else groups.backbone.dp)
            if held:
                out[part_name(e)] = wrap_part([encoder], pg, dp, groups.solo, *knobs)
            self.part_names.append(part_name(e))  # its projector trains, even when frozen
        return out

    def _ordered_p2p(self, plan: ParallelPlan, enc_plan: ParallelPlan) -> None:
        """Receive orders and one process group per message direction (see Executor)."""
        from megatron_mllm.runtime.engine.program import all_programs, message_pairs, receive_orders

        job = self.job
        main = all_programs(job.schedule, plan, enc_plan, self.enc_tp)
        pool, ahead = {}, {}
        if job.data.coreset is not None:
            pool = all_programs(job.data.pool_schedule, plan, enc_plan, self.enc_tp)
            pool = {r: forward_only_program(p) for r, p in pool.items()}
        if job.data.lookahead_schedule is not None:
            ahead = all_programs(job.data.lookahead_schedule, plan, enc_plan, self.enc_tp)
        # new_group is collective: every rank creates every new pair's group, in the same
        # order (the pairs come from every rank's program); a re-plan reuses those it has.
        pairs = message_pairs(main, pool, ahead)
        for pair in pairs:
            if pair not in self.pair_groups:
                self.pair_groups[pair] = dist.new_group(list(pair))
        groups = {pair: self.pair_groups[pair] for pair in pairs}
        self.ordered = (receive_orders(main, self.rank), groups)
        self.pool_ordered = (receive_orders(pool, self.rank), groups)
        self.ahead_ordered = (receive_orders(ahead, self.rank), groups)
        evaluation = {r: forward_only_program(p) for r, p in main.items()}
        self.eval_ordered = (receive_orders(evaluation, self.rank), groups)

    def gathered_unit_times(self) -> list[dict]:
        """Every rank's measured unit times (collective), with the DP collectives' rates (timed
        here once, after the unit times were last cleared)."""
        if not any(key[0] == "dp" for key in self.unit_times):
            self.probe_dp_rates()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.unit_times)
        return gathered

    def probe_dp_rates(self) -> None:
        """Time one DDP bucket's reduce-scatter and all-gather over the world (collective) and
        keep their rates beside the unit times ("dp", "gbps", kind), as the cost model reads
        them (`link_probe.dp_collective_gbps`)."""
        from megatron_mllm.runtime.planning.link_probe import dp_collective_gbps

        opt, dtype = self.job.optimizer, self.job.model.dtype
        grads = torch.float32 if opt.grad_reduce_in_fp32 else dtype
        rates = dp_collective_gbps(self.device, opt.ddp_bucket_size, dtype, grads)
        for kind, gbps in rates.items():
            self.unit_times.setdefault(("dp", "gbps", kind), []).append(gbps)

    def replan(self, gathered: list[dict] | None = None) -> bool:
        """Online re-planning (collective unless `gathered`, every rank's unit times, is
        given): plan Optimus again from the measured unit times and run the new schedule from
        the next step. False where the schedule keeps the encoder on stage 0 or the new plan
        needs other modules."""
        from megatron_mllm.runtime.planning.replan import replan_job

        if self.coreset is not None:  # no rows' broadcast left open across the re-plan
            self.coreset.settle()
        if gathered is None:
            gathered = self.gathered_unit_times()
        out = replan_job(self.job, gathered)
        if out is None:
            return False
        data = None
        if self.coreset is not None:  # its pool pass and merge, planned again on the times
            data = self.coreset.replanned_data(out[0], out[1], out[2])
        self.use_schedule(out[0], data)
        self.replanned = out
        return True

    def use_schedule(self, schedule, data=None) -> None:
        """Run `schedule` from the next step: another schedule for the same modules (the
        same encoder plan and backbone split; collective where messages are ordered); `data`:
        the job's DataParts with pool and look-ahead schedules made for it."""
        plans = replace(self.job.plans, schedule=schedule)
        job = replace(self.job, plans=plans, data=data or self.job.data)
        check_job(job, dist.get_world_size())
        self.job = job
        for sync in self.grad_sync.values():
            sync.relearn()
        self.program = gpu_program(schedule, self.groups, self.enc_tp)
        self.eval_program = forward_only_program(self.program)
        if self.ordered is not None:
            enc_plan, stage0 = encoder_plan_of(schedule, job.backbone)
            self._ordered_p2p(job.backbone, job.backbone if stage0 else enc_plan)
        if self.coreset is not None and data is not None:
            self.coreset.rebuild()

    def executor_for(self, program, meta, data, **options):
        """An Executor for one pass of `program` over this rank's modules."""
        from megatron_mllm.runtime.engine.executor import Executor, PassOptions

        job = self.job
        grad_sync = options.pop("grad_sync", None)
        settings = {"timeout_s": job.timeout_s, "recv_lookahead": job.executor.recv_lookahead}
        return Executor(
            program,
            meta,
            job.cfg,
            self.rank,
            self.chunks,
            self.encoders,
            data,
            job.micro_batch,
            grad_sync,
            PassOptions(**{**settings, **options}),
        )

    def evaluate(self, data) -> dict:
        """One forward-only pass of the training schedule over `data(mb, dp)` (validation);
        the last stage returns {"losses": {mb: loss}, "matches": {mb: (exact, answered)}}."""
        if self.coreset is not None:
            self.coreset.settle()
        self.sync_params()
        dp = self.groups.coords.dp
        executor = self.executor_for(
            self.eval_program,
            self.job.schedule.meta,
            lambda m: data(m, dp),
            kind=PassKind.EVAL,
            ordered=self.eval_ordered,
        )
        for module in self.rank_model.modules:  # no dropout (and no RNG draws) in validation
            module.eval()
        try:
            result = executor.run_step()
        finally:
            for module in self.rank_model.modules:
                module.train()
        return {"losses": result.losses, "matches": result.matches}

    def step(self, step: int) -> None:
        """One training step: its data (the coreset's rows), its program, the update."""
        from megatron_mllm.runtime.assembly.optimizer import allreduce_sequence_parallel_grads

        job = self.job
        self.rank_model.zero_grad()
        for sync in self.grad_sync.values():
            sync.zero()
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        data = self.coreset.data(step) if self.coreset is not None else self.data.step(step)
        tokens = self._labelled_tokens(data) if job.data.per_token_loss else None
        executor, slot, ahead = self._step_executor(step, data, tokens)
        if job.faults.fail_rank == self.rank:
            executor.run_step()
            os._exit(3)  # die mid-step, as a crashed rank would
        with self.saved.tracking() if self.saved is not None else contextlib.nullcontext():
            result = executor.run_step()
        allreduce_sequence_parallel_grads(self.chunks, self.groups.backbone.tp)
        if ahead is not None:  # chosen before the update: with the step's own weights
            self.coreset.keep(step + 1, executor.picked)
        self._record(step, result, slot, tokens)
        self.last_loss = self._mean_loss(self.history[-1], tokens)
        self.mean_losses.append(self.last_loss)
        nan_loss = not math.isfinite(self.last_loss)
        self._optimizer_step(skip=self.job.optimizer.check_nan and nan_loss)
        if self.coreset is not None:  # look-ahead: the next step's rows, selected now
            self.coreset.after_update()

    def _labelled_tokens(self, data) -> list[int]:
        """Per-token loss: this replica's labelled tokens in each micro-batch (on the host,
        from the loader's CPU batches)."""
        return [
            data(m, self.groups.coords.dp).labelled_tokens for m in range(self.job.num_microbatches)
        ]

    def _loss_norm(self, tokens: list[int] | None) -> torch.Tensor | None:
        """Per-token loss: DP size over the global batch's labelled tokens (a DP all-reduce;
        stays on the device), so that DDP's mean over replicas leaves every token's weight
        1 / tokens. None: the mean over micro-batches."""
        if tokens is None:
            return None
        total = torch.tensor([float(sum(tokens))], dtype=torch.float64, device=self.device)
        group = self.groups.backbone.dp
        dist.all_reduce(total, group=group)
        return (dist.get_world_size(group) / total.clamp(min=1.0)).float()

    def _step_executor(self, step: int, data, tokens: list[int] | None = None) -> tuple:
        """(executor, slot of each program micro-batch, the next pool or None) for one step:
        the static program, the step's own (optimus-adaptive), or the look-ahead one."""
        job, c = self.job, self.groups.coords
        program, meta, ordered, order = self.program, job.schedule.meta, self.ordered, None
        if self.adaptive is not None and self.coreset is None:
            program, meta, ordered, order = self.adaptive.program(step, data)
        slot = order.__getitem__ if order is not None else int
        get, ahead, after = (lambda m: data(slot(m), c.dp)), None, None
        if self.coreset is not None and self.coreset.lookahead:  # the next pool goes forward
            program, meta, ordered, get, ahead, after = self.coreset.with_next_pool(step, get)
        executor = self.executor_for(
            program,
            meta,
            get,
            dynamic=job.executor.dynamic,
            ordered=ordered,
            overlap_fills=job.executor.overlap_tp_fills and self.enc_tp == 1,
            max_encoder_ahead=job.executor.max_encoder_ahead,
            grad_sync=self.grad_sync,
            loss_scale=self._backward_scale(step),
            loss_norm=self._loss_norm(tokens),
            after_program=after,
        )
        return executor, slot, ahead

    def _record(self, step: int, result, slot, tokens: list[int] | None = None) -> None:
        """What a step measured and computed: times, spans, losses (step 0's gradients). A
        per-token loss is recorded per micro-batch as its mean over its labelled tokens."""
        from megatron_mllm.models.weights import grad_shards

        c = self.groups.coords
        for key, values in result.unit_times.items():
            self.unit_times.setdefault(key, []).extend(values)
        self.seconds.append(result.seconds)
        self.breakdowns.append(breakdown_of_spans(result.spans, result.seconds))
        self.compute_seconds.append(busy_seconds(result.spans, "compute"))
        self.dp_seconds.append(busy_seconds(result.spans, "dp"))  # DP waits not hidden
        self.spans = result.spans
        self.moved = result.moved
        self.overlapped, self.overlapped_in = result.overlapped, result.overlapped_in
        self.deferred_products = result.deferred_products
        per = (lambda m: max(tokens[slot(m)], 1)) if tokens is not None else (lambda m: 1)
        self.history.append({(c.dp, slot(m)): v / per(m) for m, v in result.losses.items()})
        if self.job.collect.grads and step == 0:
            self.grads = {k: v for m in self.chunks for k, v in grad_shards(m, c.tp).items()}
            if self.encoder is not None and (
                self.stage0 or (c.enc_slot, c.enc_row, c.dp) == (0, 0, 0)
            ):
                for encoder in self.encoders:
                    self.grads.update(grad_shards(encoder, c.enc_tp if not self.stage0 else c.tp))

    def _mean_loss(self, losses: dict, tokens: list[int] | None = None) -> float:
        """The step's mean loss over every replica's micro-batches, or with `tokens` over every
        labelled token (collective: the last-stage ranks hold the losses)."""
        from megatron_mllm.models.loss import mean_over_ranks

        weight = {k: (tokens[k[1]] if tokens is not None else 1) for k in losses}
        return mean_over_ranks([(v * weight[k], weight[k]) for k, v in losses.items()], self.device)

    def _optimizer_step(self, skip: bool) -> None:
        """Clip by the whole model's norm and step, or skip (and count) a step whose loss
        (`skip`) or norm is NaN or Inf: the same loss and norm on every rank, so every rank
        skips. Without --check-for-nan-in-loss-and-grad only fp16's overflow skips."""
        from megatron_mllm.runtime.assembly.optimizer import (
            clip_by_global_norm,
            step_megatron_optimizer,
        )

        opt = self.job.optimizer
        if opt.distributed and self.optimizer is not None:  # its own clipping, on its shards
            if skip:
                applied, self.last_grad_norm = False, float("nan")
            else:
                applied, self.last_grad_norm = step_megatron_optimizer(
                    self.optimizer, opt.check_nan
                )
            self.skipped_iterations += not applied
            for sync in self.grad_sync.values():
                sync.stepped()
            return
        clip = opt.clip_grad if self.optimizer is not None else 0.0
        self.last_grad_norm = clip_by_global_norm(self.parts, clip, self.device)
        if skip or (opt.check_nan and not math.isfinite(self.last_grad_norm)):
            self.skipped_iterations += 1
        elif self.optimizer is not None:
            self.optimizer.step()

    def _backward_scale(self, step: int) -> torch.Tensor | None:
        """What the loss is multiplied by before its backward: fp16's loss scale (else None);
        NaN in the test hook's steps."""
        scale = self._loss_scale_tensor()
        if step not in self.job.faults.nan_loss_steps:
            return scale
        nan = torch.tensor(float("nan"), device=self.device)
        return nan if scale is None else scale * nan

    def _loss_scale_tensor(self) -> torch.Tensor | None:
        """fp16: megatron-core's current loss scale (on the device; not read here)."""
        return None if self.grad_scaler is None else self.grad_scaler.scale

    @property
    def grad_scaler(self):
        """fp16: megatron-core's dynamic loss scaler (one for every part), else None."""
        if self.optimizer is None or self.job.model.precision != "fp16":
            return None
        return self.optimizer.chained_optimizers[0].grad_scaler

    @property
    def loss_scale(self) -> float | None:
        """The loss scale for the log line (fp16 only; reads the device)."""
        scale = self._loss_scale_tensor()
        return None if scale is None else float(scale)

    def sync_params(self) -> None:
        """Every parameter current (with overlapped gathering the last step's update is
        gathered by the next step's AG; a reader outside a step waits for it here)."""
        for key in sorted(self.grad_sync):  # one order on every rank
            self.grad_sync[key].finish_gather()

    def result(self) -> dict:
        """What the run measured and computed, for the caller (`run_result.run_result`)."""
        from megatron_mllm.runtime.modes.run_result import run_result

        return run_result(self)

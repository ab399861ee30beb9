"""The baseline users run today: megatron-core's own 1F1B (forward_backward_pipelining_without_
interleaving, or no pipelining for PP 1) with the encoder and projector in stage 0's forward,
each model chunk in megatron-core's DistributedDataParallel and its finalize_model_grads run by
the schedule (DP reduction, sequence-parallel norm gradients), as Megatron's training loop does.

megatron-core's schedules read their groups from `parallel_state`, so this mode initialises it
(in its own processes); our executor never does.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn

from megatron_mllm.data.batch import IGNORE_INDEX
from megatron_mllm.models.loss import mean_over_ranks
from megatron_mllm.models.stages import encode
from megatron_mllm.runtime.engine.breakdown import ScheduleTimer


class _Stage0Model(nn.Module):
    """Encoder + projector + backbone stage, with what megatron-core's schedules expect."""

    def __init__(self, encoder, backbone) -> None:
        super().__init__()
        self.encoder, self.backbone = encoder, backbone  # encoder: None except on chunk 0
        self.config = backbone.gpt.config
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder
        # What megatron-core's finalize_model_grads asks the (unwrapped) model.
        self.pre_process, self.post_process = backbone.pre_process, backbone.post_process
        self.share_embeddings_and_output_weights = False

    def set_input_tensor(self, tensor) -> None:
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        self._input = tensor
        if not self.backbone.pre_process:
            self.backbone.set_input_tensor(tensor)

    def forward(self, batch):
        if self.backbone.pre_process:
            embeds = encode(self.encoder, batch)
            return self.backbone(None, self.backbone.decoder_input([embeds], batch), batch)
        return self.backbone(self._input, batch=batch)


class MegatronCoreRun:
    """megatron-core's schedule on one job: built once, then `step()` as often as wanted."""

    def __init__(self, rank: int, job, device: torch.device) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_mllm.runtime.assembly.model_builder import (
            BackbonePlacement,
            EncoderPlacement,
            build_job_model,
        )
        from megatron_mllm.runtime.job import layer_overrides

        self.job, self.device, plan = job, device, job.backbone
        vpp = plan.vpp if plan.vpp > 1 else None
        if not ps.model_parallel_is_initialized():
            ps.destroy_global_memory_buffer()  # initialize_model_parallel makes its own
            ps.initialize_model_parallel(
                plan.tp,
                plan.pp,
                virtual_pipeline_model_parallel_size=vpp,
                create_gloo_process_groups=False,
            )
        pg = ProcessGroupCollection.use_mpu_process_groups()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        stage = ps.get_pipeline_model_parallel_rank()
        solo, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
        # NCCL: batched p2p (upstream's default). Gloo matches a batch's messages in posting
        # order, which interleaved PP=2 gets wrong (MEGATRON_CORE_ON_CPU.md).
        from megatron_mllm.runtime.assembly.bootstrap import nccl_messages

        overrides = {"batch_p2p_comm": nccl_messages()}
        overrides["batch_p2p_sync"] = overrides["batch_p2p_comm"]
        if job.plans.backbone_first_stage_layers is not None and plan.pp > 1:
            rest = job.cfg.llm_layers - job.plans.backbone_first_stage_layers
            layers = [job.plans.backbone_first_stage_layers] + [rest // (plan.pp - 1)] * (
                plan.pp - 1
            )
            overrides.update(layer_overrides(layers, plan.pp))
        encoder = None
        if stage == 0:
            enc_pg = ProcessGroupCollection()
            enc_pg.tp, enc_pg.cp, enc_pg.dp, enc_pg.pp = pg.tp, pg.cp, pg.dp, solo
            encoder = EncoderPlacement(enc_pg, plan.tp, self.tp_rank)
        backbone = BackbonePlacement(
            pg,
            plan.tp,
            self.tp_rank,
            plan.pp,
            stage,
            plan.vpp,
            job.plans.sequence_parallel,
            overrides,
        )
        self.rank_model = build_job_model(job.model, backbone, encoder, device)
        self.chunks = self.rank_model.chunks
        self.backbone = self.rank_model.backbone  # the one holding the loss on the last stage
        self.encoder = self.rank_model.encoders[0]
        self.models = [
            _Stage0Model(self.encoder if v == 0 else None, c) for v, c in enumerate(self.chunks)
        ]
        self.model = torch.nn.ModuleList(self.models)
        self.ddps = _wrap_in_ddp(self.models, job.optimizer, job.data.per_token_loss)
        self._time_finalize()
        self.optimizer = _megatron_optimizer(self.ddps, job)
        self.dp_rank = ps.get_data_parallel_rank()
        from megatron_mllm.runtime.inputs.batches import StepData

        self.data = StepData(job, [self.dp_rank])
        self.last_grad_norm, self.skipped_iterations = float("nan"), 0
        self.saved = None
        if job.collect.memory:
            from megatron_mllm.runtime.assembly.memory import SavedActivations

            self.saved = SavedActivations(self.rank_model.modules)
        self.fb = get_forward_backward_func()
        self.timer = ScheduleTimer()  # where the step's time goes (breakdown.py)
        self.breakdowns: list = []
        self.seconds, self.history, self.grads = [], [], None
        self.mean_losses: list[float] = []  # every step's, over every replica

    def step(self, step: int) -> None:
        from megatron_mllm.models.weights import grad_shards
        from megatron_mllm.runtime.engine.clock import StepClock

        job, backbone, device = self.job, self.backbone, self.device

        per_token = job.data.per_token_loss

        def loss_func(batch, logits):
            loss = backbone.loss(logits, batch, summed=per_token)
            if not per_token:  # the schedule divides loss in place
                return loss, {"lm loss": loss.detach().clone()}
            # megatron-core's per-token contract: (sum, tokens, what to report); its
            # finalize_model_grads divides every gradient by the global batch's tokens.
            tokens = (batch.labels != IGNORE_INDEX).sum().to(torch.int)
            return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.to(loss.dtype)])}

        data = self.data.step(step)

        def microbatches():  # built inside the timed step, as the executor builds its own
            for m in range(job.num_microbatches):
                yield data(m, self.dp_rank).to(device, job.model.dtype)

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            return model(batch), partial(loss_func, batch)

        self.rank_model.zero_grad()
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        clock = self.clock = StepClock(device)
        self._dp_marks: list = []
        iterators = [microbatches() for _ in self.models]  # every chunk reads its own copy
        tracking = self.saved.tracking() if self.saved is not None else contextlib.nullcontext()
        with tracking, self.timer.timing(clock):
            reduced = self.fb(
                forward_step_func=forward_step,
                data_iterator=iterators if len(self.models) > 1 else iterators[0],
                model=self.ddps,
                num_microbatches=job.num_microbatches,
                seq_length=job.cfg.seq_len,
                micro_batch_size=job.micro_batch,
                forward_only=False,
            )
        if not self.job.optimizer.distributed:  # main_grad: reduced by finalize_model_grads
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = p.main_grad
        end = clock.mark()
        clock.finish()
        self.seconds.append(clock.since_start(end))
        self.dp_seconds.append(sum(clock.between(a, b) for a, b in self._dp_marks))
        self.breakdowns.append(self.timer.breakdown(clock, self.seconds[-1], self._dp_marks))
        losses = torch.stack([r["lm loss"] for r in reduced]).tolist() if reduced else []
        pairs = losses if per_token else [(v, 1.0) for v in losses]
        self.mean_losses.append(mean_over_ranks(pairs, device))
        if per_token:  # each micro-batch's mean over its labelled tokens
            losses = [total / max(count, 1.0) for total, count in losses]
        self.history.append({(self.dp_rank, m): v for m, v in enumerate(losses)})
        if step == 0 and not self.job.optimizer.distributed:  # (shards only under the DO)
            self.grads = {}
            for module in self.rank_model.modules:
                self.grads.update(grad_shards(module, self.tp_rank))
        if self.optimizer is not None:  # upstream's step: clipping, update, gather
            applied, norm, _ = self.optimizer.step()
            self.last_grad_norm, self.skipped_iterations = (
                norm,
                self.skipped_iterations + (not applied),
            )

    def _time_finalize(self) -> None:
        """Mark megatron-core's finalize_model_grads (the DP reduction's wait at the end of
        its schedule) so that its seconds are the step's unhidden DP time."""
        config = self.ddps[0].config
        finalize = config.finalize_model_grads_func

        def timed(*args, **kwargs):
            start = self.clock.mark()
            out = finalize(*args, **kwargs)
            self._dp_marks.append((start, self.clock.mark()))
            return out

        config.finalize_model_grads_func = timed
        self.dp_seconds: list[float] = []

    def replan(self) -> bool:
        return False

    def result(self) -> dict:
        out = {
            "losses": self.history[0],
            "mean_losses": self.mean_losses,
            "history": self.history,
            "grads": self.grads,
            "seconds": self.seconds,
            "dp_seconds": self.dp_seconds,  # per step: finalize_model_grads (unhidden DP)
            "breakdowns": [b.as_dict() for b in self.breakdowns],
            "spans": [],
            "skipped_iterations": self.skipped_iterations,
        }
        if self.saved is not None:
            from megatron_mllm.runtime.assembly.memory import model_state_bytes

            out["memory"] = model_state_bytes(self.rank_model.modules, self.ddps, self.optimizer)
            out["memory"]["activations"] = self.saved.peak
        if self.job.collect.params:
            from megatron_mllm.models.weights import param_shards

            if self.job.optimizer.overlap_param_gather:  # the next forward would gather
                for ddp in self.ddps:
                    ddp.start_param_sync(force_sync=True)
            out["params"] = {}
            for module in self.rank_model.modules:
                out["params"].update(param_shards(module, self.tp_rank))
        return out


def _wrap_in_ddp(models: list[nn.Module], opt, per_token_loss: bool = False) -> list:
    """Each model chunk in megatron-core's DistributedDataParallel on parallel_state's groups,
    with megatron-core's finalize_model_grads (DP reduction, sequence-parallel norm gradients)
    run by the schedule at the end of its backward and, with overlapped reduction, the no-sync
    and grad-sync hooks, as Megatron's training loop sets them up (`opt`: OptimizerSettings)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=opt.grad_reduce_in_fp32,
        overlap_grad_reduce=opt.overlap_grad_reduce,
        bucket_size=opt.ddp_bucket_size if opt.overlap_grad_reduce else None,
        use_distributed_optimizer=opt.distributed,
        overlap_param_gather=opt.overlap_param_gather,
    )
    for m in models:  # read by DDP (no averaging over DP) and the schedule (no division)
        m.config.calculate_per_token_loss = per_token_loss
    ddps = [DistributedDataParallel(m.config, ddp_config, m) for m in models]
    config = ddps[0].config
    config.finalize_model_grads_func = finalize_model_grads
    if opt.overlap_grad_reduce:
        one = len(ddps) == 1
        config.no_sync_func = ddps[0].no_sync if one else [d.no_sync for d in ddps]
        config.grad_sync_func = (
            ddps[0].start_grad_sync if one else [d.start_grad_sync for d in ddps]
        )
    return ddps


def _megatron_optimizer(ddps: list, job):
    """megatron-core's optimizer over the chunks (get_megatron_optimizer on parallel_state's
    groups: its own clipping and, with the distributed optimizer, sharding); None without a
    learning rate."""
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_mllm.runtime.assembly.optimizer import _adam_config

    opt = job.optimizer
    if opt.lr <= 0:
        return None
    config = _adam_config(
        opt.lr,
        0.0,
        opt.clip_grad,
        job.model.dtype,
        opt.min_lr,
        opt.distributed,
        opt.overlap_param_gather,
        opt.initial_loss_scale,
    )
    optimizer = get_megatron_optimizer(config, ddps, use_gloo_process_groups=False)
    if config.fp16:  # the schedule scales each loss before its backward, as Megatron's loop
        ddps[0].config.grad_scale_func = optimizer.scale_loss
    return optimizer

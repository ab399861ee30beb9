"""The baseline users run today: megatron-core's own 1F1B (forward_backward_pipelining_without_
interleaving, or no pipelining for PP 1) with the encoder and projector in stage 0's forward.

megatron-core's schedules read their groups from `parallel_state`, so this mode initialises it
(in its own processes); our executor never does.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn


class _Stage0Model(nn.Module):
    """Encoder + projector + backbone stage, with what megatron-core's schedules expect."""

    def __init__(self, encoder, backbone) -> None:
        super().__init__()
        self.encoder, self.backbone = encoder, backbone  # encoder: None except on chunk 0
        self.config = backbone.gpt.config
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor) -> None:
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        self._input = tensor
        if not self.backbone.pre_process:
            self.backbone.set_input_tensor(tensor)

    def forward(self, images, text):
        if self.backbone.pre_process:
            embeds = self.encoder(images)
            return self.backbone(None, self.backbone.decoder_input([embeds], text))
        return self.backbone(self._input)


class MegatronCoreRun:
    """megatron-core's schedule on one job: built once, then `step()` as often as wanted."""

    def __init__(self, rank: int, job) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_mllm.models.stages import BackboneStage, EncoderStage
        from megatron_mllm.models.weights import load_full_state
        from megatron_mllm.runtime.job import layer_overrides

        self.job, plan = job, job.backbone
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
        self.tp_rank, self.tp_group = ps.get_tensor_model_parallel_rank(), pg.tp
        stage = ps.get_pipeline_model_parallel_rank()
        solo, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
        overrides = {}
        if job.backbone_first_stage_layers is not None and plan.pp > 1:
            rest = job.cfg.llm_layers - job.backbone_first_stage_layers
            layers = [job.backbone_first_stage_layers] + [rest // (plan.pp - 1)] * (plan.pp - 1)
            overrides = layer_overrides(layers, plan.pp)
        if vpp:  # interleaved: one model chunk per virtual stage, layers spread evenly
            overrides["virtual_pipeline_model_parallel_size"] = vpp
        chunks = range(plan.vpp)
        self.chunks = [
            BackboneStage(
                job.cfg,
                stage == 0 and v == 0,
                stage == plan.pp - 1 and v == plan.vpp - 1,
                pg,
                plan.tp,
                plan.pp,
                vp_stage=v if vpp else None,
                sequence_parallel=job.sequence_parallel,
                **overrides,
            )
            for v in chunks
        ]
        for chunk in self.chunks:
            load_full_state(chunk, job.full_state, self.tp_rank, plan.tp)
        self.backbone = self.chunks[-1]  # the one holding the loss on the last stage
        self.encoder = None
        if stage == 0:
            enc_pg = ProcessGroupCollection()
            enc_pg.tp, enc_pg.cp, enc_pg.dp, enc_pg.pp = pg.tp, pg.cp, pg.dp, solo
            self.encoder = EncoderStage(job.cfg, 0, 1, enc_pg, plan.tp)
            load_full_state(self.encoder, job.full_state, self.tp_rank, plan.tp)
            if job.frozen_encoder:
                self.encoder.freeze()
        self.models = [
            _Stage0Model(self.encoder if v == 0 else None, c) for v, c in enumerate(self.chunks)
        ]
        self.model = torch.nn.ModuleList(self.models)
        self.dp_rank, self.dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
        self.fb = get_forward_backward_func()
        self.seconds, self.history, self.grads = [], [], None

    def step(self, step: int) -> None:
        from megatron_mllm.models.weights import grad_shards
        from megatron_mllm.runtime.optimizer import allreduce_sequence_parallel_grads
        from megatron_mllm.runtime.session import _data

        job, backbone = self.job, self.backbone

        def loss_func(text, logits):
            loss = backbone.loss(logits, text)
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place

        def forward_step(data_iterator, model):
            images, text = next(data_iterator)
            return model(images, text), partial(loss_func, text)

        for p in self.model.parameters():
            p.grad = None
        data = _data(job, step)
        batches = [data(m, self.dp_rank) for m in range(job.num_microbatches)]
        iterators = [iter(batches) for _ in self.models]  # every chunk reads its own copy
        t0 = time.perf_counter()
        reduced = self.fb(
            forward_step_func=forward_step,
            data_iterator=iterators if len(self.models) > 1 else iterators[0],
            model=self.models,
            num_microbatches=job.num_microbatches,
            seq_length=job.cfg.seq_len,
            micro_batch_size=job.micro_batch,
            forward_only=False,
        )
        allreduce_sequence_parallel_grads(self.chunks, self.tp_group)
        _all_reduce_dp(self.model, self.dp_group, job.backbone.dp)
        self.seconds.append(time.perf_counter() - t0)
        self.history.append({(self.dp_rank, m): float(r["lm loss"]) for m, r in enumerate(reduced)})
        if step == 0:
            self.grads = {}
            for chunk in self.chunks:
                self.grads.update(grad_shards(chunk, self.tp_rank))
            if self.encoder is not None:
                self.grads.update(grad_shards(self.encoder, self.tp_rank))

    def result(self) -> dict:
        return {
            "losses": self.history[0],
            "history": self.history,
            "grads": self.grads,
            "seconds": self.seconds,
            "spans": [],
        }


def _all_reduce_dp(model: nn.Module, group, dp: int) -> None:
    if dp == 1:
        return
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= dp

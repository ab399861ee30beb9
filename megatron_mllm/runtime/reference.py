"""The one-process, non-pipelined reference: the canonical weights every layout starts from (a
model built from a seed), and the reference training run every parallel layout must match."""

from __future__ import annotations

import torch

from megatron_mllm.models.config import MLLMConfig


def make_full_state(rank: int, world: int, cfg: MLLMConfig, seed: int) -> dict[str, torch.Tensor]:
    """Run in a fresh single-rank process (see `launch.spawn`); returns canonical tensors."""
    from megatron_mllm.models.stages import BackboneStage, EncoderStage
    from megatron_mllm.models.weights import full_state
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.session import _init_rank

    _init_rank(rank, world, seed, 60.0)
    one = ParallelPlan(1, 1, 1)
    groups = build_colocated_groups(one, one, 1, 0)
    encoders = [
        EncoderStage(cfg, 0, 1, groups.encoder, 1, index=e) for e in range(cfg.num_encoders)
    ]
    backbone = BackboneStage(cfg, True, True, groups.backbone, 1, 1)
    return full_state(*encoders, backbone)


def reference_run(job) -> dict:
    """Every micro-batch of every DP replica in turn, in one process (no parallelism)."""
    from megatron_mllm.models.stages import BackboneStage, EncoderStage
    from megatron_mllm.models.weights import grad_shards, load_full_state
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.optimizer import build_optimizer, clip_by_global_norm
    from megatron_mllm.runtime.session import _data

    one = ParallelPlan(1, 1, 1)
    groups = build_colocated_groups(one, one, 1, 0)
    encoders = [
        EncoderStage(job.cfg, 0, 1, groups.encoder, 1, index=e) for e in range(job.cfg.num_encoders)
    ]
    backbone = BackboneStage(job.cfg, True, True, groups.backbone, 1, 1)
    for module in (*encoders, backbone):
        load_full_state(module, job.full_state, 0, 1)
    if job.frozen_encoder:
        for encoder in encoders:
            encoder.freeze()
    optimizer = build_optimizer([*encoders, backbone], job.lr) if job.lr > 0 else None
    n = job.num_microbatches * job.backbone.dp
    history = []
    for step in range(job.steps):
        for p in [p for m in (*encoders, backbone) for p in m.parameters()]:
            p.grad = None
        losses = {}
        data = _data(job, step)
        for dp in range(job.backbone.dp):
            for m in range(job.num_microbatches):
                images, text = data(m, dp)
                embeds = [encoder(images) for encoder in encoders]
                out = backbone(None, backbone.decoder_input(embeds, text))
                loss = backbone.loss(out, text)
                (loss / n).backward()
                losses[(dp, m)] = loss.item()
        history.append(losses)
        if step == 0:
            grads = {k: v for m in (*encoders, backbone) for k, v in grad_shards(m, 0).items()}
        if optimizer is not None:
            clip_by_global_norm([(m, None, None) for m in (*encoders, backbone)], job.clip_grad)
            optimizer.step()
    return {"losses": history[0], "history": history, "grads": grads}

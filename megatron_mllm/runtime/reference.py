"""The canonical weights every layout starts from: a one-process model built from a seed."""

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

"""Deterministic synthetic image-text micro-batches (for tests and benchmarks: no downloads)."""

from __future__ import annotations

import torch

from megatron_mllm.models.config import MLLMConfig


def microbatch(
    cfg: MLLMConfig, index: int, micro_batch: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch `index`: images [b, c, H, W] and text tokens [b, text_len].

    The same index gives the same tensors in every process, whatever the parallel layout.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    images = torch.randn(micro_batch, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    text = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.text_len), generator=g)
    return images, text

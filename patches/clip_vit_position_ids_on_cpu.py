"""Keep megatron-core's CLIPViTModel position ids on the host on machines without CUDA.

TARGET: megatron/core/models/vision/clip_vit_model.py:124
        (`self.position_ids = torch.arange(self.seq_length).expand(1, -1).cuda()`).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (CPU build).
WHY: the constructor moves its position ids to CUDA unconditionally, which raises on a CPU-only
machine although the model is otherwise built on the host (`use_cpu_initialization`). This
patch makes `Tensor.cuda` return the tensor itself while that constructor runs, and only there.
Applied only when `torch.cuda.is_available()` is False.
"""

from __future__ import annotations

import functools

import torch

TARGET = "megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__ (its .cuda() call)"
CHECKED_ON = ("0.16.1",)


def _on_host(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def apply() -> None:
    if torch.cuda.is_available():
        return
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    upstream = CLIPViTModel.__init__
    if getattr(upstream, "_host_position_ids_patch", False):
        return

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        cuda, torch.Tensor.cuda = torch.Tensor.cuda, _on_host
        try:
            upstream(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    __init__._host_position_ids_patch = True
    CLIPViTModel.__init__ = __init__

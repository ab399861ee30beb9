"""Let megatron-core's CLIPViTModel build its pre- and post-norms without Transformer Engine.

TARGET: megatron/core/models/vision/clip_vit_model.py:22 (`NORM_IMPL = torch.nn.LayerNorm` when
        Transformer Engine is absent) and :97-110 (`build_module(ln_pre_impl, config=...,
        hidden_size=..., eps=...)`).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0.
WHY: without Transformer Engine the default norm is torch's LayerNorm, which takes no `config`
argument, so building the CLIP tower (and megatron-core's LLaVAModel, which leaves the default)
raises a TypeError. This patch gives CLIPViTModel megatron-core's own torch-norm fallback
(`WrappedTorchNorm`: the LayerNorm or RMSNorm the config names, same parameter names) wherever
the default would be torch's LayerNorm. With Transformer Engine the default is TENorm and
nothing changes. Used by the converter of megatron-core's LLaVA layout.
"""

from __future__ import annotations

import functools
import inspect

import torch

TARGET = "megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__"
CHECKED_ON = ("0.16.1",)
_NORMS = ("ln_pre_impl", "ln_post_impl")


def apply() -> None:
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    upstream = CLIPViTModel.__init__
    if getattr(upstream, "_torch_norm_patch", False):
        return
    signature = inspect.signature(upstream)

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        for name in _NORMS:
            if bound.arguments[name] is torch.nn.LayerNorm:
                bound.arguments[name] = WrappedTorchNorm
        upstream(*bound.args, **bound.kwargs)

    __init__._torch_norm_patch = True
    CLIPViTModel.__init__ = __init__

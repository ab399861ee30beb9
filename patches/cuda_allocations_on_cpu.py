"""Allocate megatron-core's hard-coded `device="cuda"` scratch tensors on the CPU when there is
no CUDA.

TARGET: megatron/core/pipeline_parallel/schedules.py:596, 983, 2138 (the token counter of every
        forward_backward_* function); megatron/core/optimizer/optimizer.py:473, 481, 485, 907
        (loss-scale and overflow buffers, FP32Optimizer._scale); optimizer/clip_grads.py:90, 103,
        115, 174, 207 (norm and zero-count buffers); optimizer/grad_scaler.py:15, 88, 91, 94
        (the fp16 loss scaler's scale, minimum, growth and backoff factors).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (CPU build).
WHY: these are plain scalars and buffers; "cuda" is hard-coded. Each target module gets a `torch`
whose tensor factories map device="cuda" to the CPU; everything else is torch itself.
"""

from __future__ import annotations

import importlib

import torch

TARGET = "module-level `torch` of megatron-core's schedules, optimizer and clip_grads modules"
CHECKED_ON = ("0.16.1",)
MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
)


class _CpuTorch:
    """torch, except that zeros/empty/ones/tensor/full with device="cuda" allocate on the CPU."""

    FACTORIES = ("zeros", "empty", "ones", "tensor", "full")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in self.FACTORIES:

            def factory(*args, _f=value, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return _f(*args, **kwargs)

            return factory
        return value


def apply() -> None:
    if torch.cuda.is_available():
        return
    for name in MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorch):
            module.torch = _CpuTorch()

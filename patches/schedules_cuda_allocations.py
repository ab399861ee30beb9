"""Allocate the schedules' token counter on the CPU when there is no CUDA.

TARGET: megatron/core/pipeline_parallel/schedules.py:596, 983, 2138
        (`torch.zeros([], dtype=torch.int, device="cuda")` in every forward_backward_* function).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (CPU build).
WHY: the counter is a plain accumulator; "cuda" is hard-coded. We give the schedules module a
`torch` whose tensor factories map device="cuda" to the CPU; everything else is torch itself.
"""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import schedules

TARGET = "megatron.core.pipeline_parallel.schedules (module-level name `torch`)"
CHECKED_ON = ("0.16.1",)


class _CpuTorch:
    """torch, except that zeros/empty/ones/tensor with device="cuda" allocate on the CPU."""

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in ("zeros", "empty", "ones", "tensor", "full"):

            def factory(*args, _f=value, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return _f(*args, **kwargs)

            return factory
        return value


def apply() -> None:
    if torch.cuda.is_available() or isinstance(schedules.torch, _CpuTorch):
        return
    schedules.torch = _CpuTorch()

"""A TorchFunctionMode that fails on a tensor factory called from our code without a device.

On a CPU-only machine a tensor made without `device=` lands where every other tensor is, so a
forgotten device never shows; on a GPU it is a CPU tensor beside CUDA ones (a device mismatch,
or a CPU tensor handed to an NCCL group). Run code under `ExplicitDevices()` to catch the next
one here. `*_like` factories follow their tensor and are allowed."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
OURS = (str(ROOT / "megatron_mllm"), str(ROOT / "patches"))
TORCH = str(Path(torch.__file__).parent)
# Our patches that forward upstream's own factory calls: the caller is upstream, not us.
FORWARDERS = (str(ROOT / "patches" / "cuda_allocations_on_cpu.py"),)
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange, torch.randn,
    torch.rand, torch.randint, torch.eye, torch.linspace, torch.as_tensor, torch.randperm,
}  # fmt: skip


def _caller() -> str:
    """The first frame outside torch and this module: who called the factory."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH) and name not in (__file__, *FORWARDERS):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class ExplicitDevices(TorchFunctionMode):
    """Records (and with `strict`, raises on) factories from our code without `device=`."""

    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.strict, self.violations = strict, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            where = _caller()
            if where.startswith(OURS):
                self.violations.append(f"{func.__name__} without a device at {where}")
                if self.strict:
                    raise AssertionError(self.violations[-1])
        return func(*args, **kwargs)

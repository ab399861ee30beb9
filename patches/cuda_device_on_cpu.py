"""Resolve `torch.cuda.current_device()` to the CPU and make `torch.cuda.synchronize()` a no-op
on machines without CUDA.

TARGET: megatron/core/utils.py:631 (GlobalMemoryBuffer.get_tensor),
        tensor_parallel/mappings.py:91, pipeline_parallel/p2p_communication.py:190-202, 242, 313,
        321, 398 (receive buffers and syncs), distributed/param_and_grad_buffer.py:800/806,
        models/common/embeddings/rotary_pos_embedding.py:297 (MultimodalRotaryEmbedding's
        inverse frequencies, made on the current device).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (CPU build).
WHY: these sites allocate on `torch.cuda.current_device()` or synchronize CUDA; on a CPU-only
machine both raise, although the tensors they make are plain buffers that work on the CPU.
Applied only when `torch.cuda.is_available()` is False, where nothing else can call them.
"""

from __future__ import annotations

import torch

TARGET = "torch.cuda.current_device / torch.cuda.synchronize (as called by megatron-core)"
CHECKED_ON = ("0.16.1",)


def _cpu_device() -> str:
    return "cpu"


def _no_sync(device=None) -> None:
    return None


def apply() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _no_sync

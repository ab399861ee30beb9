"""Let megatron-core's torch-norm fallback run under sequence parallelism.

TARGET: megatron/core/transformer/torch_norm.py:32 `WrappedTorchNorm.__new__` (the LayerNorm /
        RMSNorm of the local layer specs when Apex is absent).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0.
WHY: upstream asserts `not config.sequence_parallel`, because a torch norm does not mark its
parameters the way megatron-core's FusedLayerNorm does (`param.sequence_parallel = True`, which
tells the gradient finalisation to sum them over the TP group). The norm itself is per token and
needs nothing else. This patch builds the torch norm as upstream does and sets that mark, so
without Apex the backbone can run with sequence parallelism; our runtime then sums the marked
gradients (runtime/assembly/optimizer.py `allreduce_sequence_parallel_grads`), as
finalize_model_grads would.
"""

from __future__ import annotations

import copy

TARGET = "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"
CHECKED_ON = ("0.16.1",)

_upstream_new = None


def _new(cls, config, hidden_size: int, eps: float = 1e-5, *args, **kwargs):
    if not config.sequence_parallel:
        return _upstream_new(cls, config, hidden_size, eps, *args, **kwargs)
    plain = copy.copy(config)
    plain.sequence_parallel = False
    norm = _upstream_new(cls, plain, hidden_size, eps, *args, **kwargs)
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


def apply() -> None:
    global _upstream_new
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if _upstream_new is None:
        _upstream_new = WrappedTorchNorm.__new__
        WrappedTorchNorm.__new__ = staticmethod(_new)

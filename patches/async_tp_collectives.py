"""Issue megatron-core's tensor-parallel all-reduce asynchronously and, while it is in flight,
run the encoder kernels the schedule placed into that TP bubble.

TARGET: megatron/core/tensor_parallel/mappings.py:22 `_reduce` (the all-reduce behind
        RowParallelLinear's forward and ColumnParallelLinear's input-gradient backward, reached
        through _ReduceFromModelParallelRegion / _CopyToModelParallelRegion).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (gloo on CPU; NCCL work objects poll the same).
WHY: upstream blocks the caller in `all_reduce`; our executor wants those seconds for encoder
work (Optimus's TP-bubble fills). With no filler installed (`filling(None)`, the default) the
patched function waits at once, which is upstream's behaviour; results are identical either way
(the fills are independent of the reduced tensor). Fills must not themselves use a TP group
(an encoder TP collective inside a backbone one could interleave differently across ranks): the
executor only installs a filler when the encoder runs with TP 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

TARGET = "megatron.core.tensor_parallel.mappings._reduce"
CHECKED_ON = ("0.16.1",)

_filler: Callable[[], bool] | None = None  # runs one queued fill; False when none is left


@contextlib.contextmanager
def filling(filler: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, TP all-reduces run `filler()` until it returns False or the
    collective completes, then wait."""
    global _filler
    previous, _filler = _filler, filler
    try:
        yield
    finally:
        _filler = previous


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    assert group is not None, "group should not be None"
    if group.size() == 1:
        return input_
    work = torch.distributed.all_reduce(input_.contiguous(), group=group, async_op=True)
    filler = _filler
    while filler is not None and not work.is_completed():
        if not filler():
            break
    work.wait()
    return input_


def apply() -> None:
    from megatron.core.tensor_parallel import mappings

    mappings._reduce = _reduce

"""Issue megatron-core's tensor-parallel collectives asynchronously and, while one is in flight,
run the encoder kernels the schedule placed into that TP bubble.

TARGET: megatron/core/tensor_parallel/mappings.py
          :22 `_reduce` (all-reduce: RowParallelLinear's forward, vocab-parallel embedding),
          :12-19 `dist_all_gather_func` / `dist_reduce_scatter_func` (sequence parallelism's
          gather and reduce-scatter regions: row-parallel forward, column-parallel backward of
          the regions, the output layer);
        megatron/core/tensor_parallel/layers.py
          :79-86 `dist_all_gather_func` / `dist_reduce_scatter_func` (sequence parallelism inside
          LinearWithGradAccumulationAndAsyncCommunication: the input all-gather of forward and
          backward, the input-gradient reduce-scatter),
          :544 `torch.distributed.all_reduce(..., async_op=True)` (the column-parallel
          input-gradient all-reduce without sequence parallelism), waited at :618-624.
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (gloo on CPU; NCCL work objects poll the same).
WHY: upstream blocks the caller in each collective (or in `handle.wait()` for the ones it already
issues asynchronously); our executor wants those seconds for encoder work (Optimus's TP-bubble
fills). Every call becomes asynchronous, and every wait first runs queued fills until the
collective completes. With no filler installed (`filling(None)`, the default) each wait happens
at once, which is upstream's behaviour; results are identical either way (the fills are
independent of the tensors in flight). Fills never nest: while one runs, no filler is installed,
and the executor only installs one when the encoder runs with TP 1, so an encoder TP collective
never runs inside a backbone one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

TARGET = (
    "megatron.core.tensor_parallel.mappings._reduce, .dist_all_gather_func, "
    ".dist_reduce_scatter_func; megatron.core.tensor_parallel.layers.dist_all_gather_func, "
    ".dist_reduce_scatter_func, torch.distributed.all_reduce as layers.py calls it"
)
CHECKED_ON = ("0.16.1",)

# Runs one queued fill inside the named collective ("all_reduce", "all_gather",
# "reduce_scatter"); returns False when none is left.
_filler: Callable[[str], bool] | None = None
# Told (kind, seconds blocked in the collective without fills, whether fills ran) per wait.
_observer: Callable[[str, float, bool], None] | None = None


@contextlib.contextmanager
def filling(filler: Callable[[str], bool] | None) -> Iterator[None]:
    """Within the block, waits on backbone TP collectives run `filler(kind)` until it returns
    False or the collective completes."""
    global _filler
    previous, _filler = _filler, filler
    try:
        yield
    finally:
        _filler = previous


@contextlib.contextmanager
def observing(observer: Callable[[str, float, bool], None] | None) -> Iterator[None]:
    """Within the block, every wait on a TP collective reports to `observer(kind, seconds
    blocked without fills, filled)` (the executor's measured communication times)."""
    global _observer
    previous, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = previous


def wait_filling(work, kind: str) -> None:
    """Run fills while `work` (a `kind` collective) is in flight, then wait for it."""
    global _filler, _observer
    filler, observer = _filler, _observer
    start, in_fills, filled = time.perf_counter(), 0.0, False
    if filler is not None:
        _filler = _observer = None  # a fill's own collectives (none at encoder TP 1) don't count
        try:
            while not work.is_completed():
                t = time.perf_counter()
                if not filler(kind):
                    break
                in_fills, filled = in_fills + time.perf_counter() - t, True
        finally:
            _filler, _observer = filler, observer
    work.wait()
    if observer is not None:
        observer(kind, time.perf_counter() - start - in_fills, filled)


class FillingWork:
    """A collective's work handle whose `wait()` runs fills first."""

    def __init__(self, work, kind: str) -> None:
        self.work, self.kind = work, kind

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, *args) -> bool:
        wait_filling(self.work, self.kind)
        return True


def _asynchronous(collective: Callable, kind: str) -> Callable:
    """`collective(..., async_op=False)` that fills while in flight; with async_op=True, a
    handle whose wait fills."""

    def call(*args, async_op: bool = False, **kwargs):
        work = FillingWork(collective(*args, async_op=True, **kwargs), kind)
        if async_op:
            return work
        work.wait()
        return None

    call.fills_while_in_flight = collective  # marks ours (torch's own carry __wrapped__)
    return call


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    assert group is not None, "group should not be None"
    if group.size() == 1:
        return input_
    work = torch.distributed.all_reduce(input_.contiguous(), group=group, async_op=True)
    wait_filling(work, "all_reduce")
    return input_


class _DistributedForLayers:
    """torch.distributed as layers.py sees it: all_reduce fills; everything else is torch's."""

    all_reduce = staticmethod(_asynchronous(torch.distributed.all_reduce, "all_reduce"))

    def __getattr__(self, name):
        value = getattr(torch.distributed, name)
        setattr(self, name, value)  # later lookups skip __getattr__ (layers.py's hot path)
        return value


class _TorchForLayers:
    """torch, except that `.distributed` is `_DistributedForLayers`."""

    distributed = _DistributedForLayers()

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # later lookups skip __getattr__ (layers.py's hot path)
        return value


COLLECTIVES = {"dist_all_gather_func": "all_gather", "dist_reduce_scatter_func": "reduce_scatter"}


def apply() -> None:
    from megatron.core.tensor_parallel import layers, mappings

    mappings._reduce = _reduce
    for module in (mappings, layers):
        for name, kind in COLLECTIVES.items():
            current = getattr(module, name)
            if not hasattr(current, "fills_while_in_flight"):
                setattr(module, name, _asynchronous(current, kind))
    if not isinstance(layers.torch, _TorchForLayers):
        layers.torch = _TorchForLayers()

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
          input-gradient all-reduce without sequence parallelism), waited at :618-624;
        megatron/core/parallel_state.py :139 `_GLOBAL_MEMORY_BUFFER` (swapped while fills run).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (gloo on CPU; NCCL work objects poll the same).
WHY: upstream blocks the caller in each collective (or in `handle.wait()` for the ones it already
issues asynchronously); our executor wants those seconds for encoder work (Optimus's TP-bubble
fills). Every call becomes asynchronous, and every wait first hands the executor's filler the
collective: the filler runs at most the fills planned for that collective (its budget; the host
may run far ahead of the device, so "not completed yet" alone would drain every fill into the
first one), stopping early once the collective completes. With no filler installed
(`filling(None)`, the default) each wait happens at once, which is upstream's behaviour; results
are identical either way (the fills are independent of the tensors in flight). Fills never nest:
while one runs, no filler is installed, and the executor only installs one when the encoder runs
with TP 1, so an encoder TP collective never runs inside a backbone one.

Scratch memory: with sequence parallelism the in-flight all-gather's output is a view of
megatron-core's global "mpu" buffer (`get_global_memory_buffer().get_tensor(..., "mpu")`), and
the encoder's attention (DotProductAttention) asks the same buffer for the tensor its score
`baddbmm` starts from (and grows it, re-pointing the name, when it needs more). GlobalMemoryBuffer
requires that one name is never used by two users at once, so while fills run
`parallel_state._GLOBAL_MEMORY_BUFFER` is a separate buffer owned by fills (`fill_scratch`),
restored before the wait.

Timing: the observer is told marks, not seconds (`observing(observer, mark)`): the executor passes
its StepClock's `mark` (CUDA events on a GPU, host perf_counter on the CPU) and reads them after
the step's one synchronize. The marks bracket the wait itself, after the fills: on a GPU the pair
brackets the compute stream's stall on the collective, on the CPU the host's blocked time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

TARGET = (
    "megatron.core.tensor_parallel.mappings._reduce, .dist_all_gather_func, "
    ".dist_reduce_scatter_func; megatron.core.tensor_parallel.layers.dist_all_gather_func, "
    ".dist_reduce_scatter_func, torch.distributed.all_reduce as layers.py calls it; "
    "megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER while fills run"
)
CHECKED_ON = ("0.16.1",)

# filler(kind, done): runs the fills planned for one wait on a `kind` collective ("all_reduce",
# "all_gather", "reduce_scatter"), stopping early once done() (the collective completed) is true;
# returns how many ran.
_filler: Callable[[str, Callable[[], bool]], int] | None = None
# Told (kind, mark before the wait, mark after it, whether fills ran) per wait; marks from _mark.
_observer: Callable[[str, object, object, bool], None] | None = None
_mark: Callable[[], object] = time.perf_counter
_fill_scratch = None  # the fills' own megatron-core GlobalMemoryBuffer (made on first use)


@contextlib.contextmanager
def filling(filler: Callable[[str, Callable[[], bool]], int] | None) -> Iterator[None]:
    """Within the block, each wait on a backbone TP collective first calls `filler(kind, done)`
    once (see `_filler`)."""
    global _filler
    previous, _filler = _filler, filler
    try:
        yield
    finally:
        _filler = previous


@contextlib.contextmanager
def observing(
    observer: Callable[[str, object, object, bool], None] | None,
    mark: Callable[[], object] = time.perf_counter,
) -> Iterator[None]:
    """Within the block, every wait on a TP collective reports to `observer(kind, start, end,
    filled)`: `mark()`s taken around the wait itself, after any fills (the executor's measured
    communication times)."""
    global _observer, _mark
    previous, (_observer, _mark) = (_observer, _mark), (observer, mark)
    try:
        yield
    finally:
        _observer, _mark = previous


@contextlib.contextmanager
def fill_scratch() -> Iterator[None]:
    """Within the block, megatron-core's global scratch buffer is the one owned by fills, so a
    fill never writes into the buffer an in-flight backbone collective owns."""
    from megatron.core import parallel_state

    global _fill_scratch
    if _fill_scratch is None:
        _fill_scratch = parallel_state.GlobalMemoryBuffer()
    previous = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = _fill_scratch
    try:
        yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = previous


def wait_filling(work, kind: str) -> None:
    """Run the fills planned for `work` (a `kind` collective) while it is in flight, then wait."""
    global _filler, _observer
    filler, observer, mark = _filler, _observer, _mark
    ran = 0
    if filler is not None:
        _filler = _observer = None  # a fill's own collectives (none at encoder TP 1) don't count
        try:
            with fill_scratch():
                ran = filler(kind, work.is_completed)
        finally:
            _filler, _observer = filler, observer
    start = mark() if observer is not None else None
    work.wait()
    if observer is not None:
        observer(kind, start, mark(), ran > 0)


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

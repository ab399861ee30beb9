"""What a rank's training step holds in memory, measured: parameters, gradient buffers,
optimizer state (bytes of the tensors themselves, whatever device they are on) and the peak of
the activations autograd keeps for backward (saved-tensor hooks; each storage counted once, the
parameters' storages not at all). The planner's estimate of the same: `planned_memory`."""

from __future__ import annotations

import contextlib
import weakref

import torch

from megatron_mllm.runtime.assembly.optimizer import sub_optimizers


def _nbytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def model_state_bytes(modules: list, ddps: list, optimizer) -> dict[str, int]:
    """Parameters, gradients (megatron-core DDP's buffers, else `.grad`) and optimizer state
    (main parameters where they are copies, moments) on this rank, in bytes."""
    params = [p for m in modules if m is not None for p in m.parameters()]
    if ddps:
        grads = [buf.grad_data for ddp in ddps for buf in ddp.buffers]
    else:
        grads = [p.grad for p in params]
    state = []
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    for sub in sub_optimizers(optimizer) if optimizer is not None else []:
        for group in sub.optimizer.param_groups:
            for main in group["params"]:
                if main.untyped_storage().data_ptr() not in param_storages:
                    state.append(main)  # an fp32 copy (bf16 models), not a view of the model
                state += [v for v in sub.optimizer.state.get(main, {}).values() if v.dim()]
    return {"params": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(state)}


class SavedActivations:
    """Peak bytes of the tensors autograd saves for backward while active (a context manager
    around a step); parameters excluded, each storage counted once while any saved tensor on it
    is alive."""

    def __init__(self, modules: list) -> None:
        params = (p for m in modules if m is not None for p in m.parameters())
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._live: dict[int, list[int]] = {}  # storage -> [saved tensors alive, bytes]
        self.current = self.peak = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key in self._params or not t.numel():
            return t
        entry = self._live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        weakref.finalize(t, self._release, key)
        return t

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    @contextlib.contextmanager
    def tracking(self):
        global _TRACKING
        _TRACKING = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _TRACKING = None


_TRACKING: SavedActivations | None = None  # the meter whose `tracking` is open, if any


def held(nbytes: int) -> None:
    """Count `nbytes` more (or, negative, fewer) as saved activations where a meter is
    tracking: what a backward keeps for later work (deferred weight gradients' output
    gradients) and lets go of itself."""
    meter = _TRACKING
    if meter is not None:
        meter.current += nbytes
        meter.peak = max(meter.peak, meter.current)


def planned_memory(schedule, workload) -> list[dict[str, float]]:
    """The planner's estimate per rank: model state (parameters, gradients, optimizer state as
    megatron-core's distributed optimizer keeps them) and the peak of saved activations."""
    from megatron_mllm.schedule.simulator import simulate

    result = simulate(schedule, workload, keep_spans=False)
    return [
        {"state": state, "activations": act}
        for state, act in zip(workload.state_bytes, result.activation_peaks, strict=True)
    ]

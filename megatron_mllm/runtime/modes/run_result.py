"""An ExecutorRun's result: losses, times, spans, breakdowns, DDP and optimizer facts, and what
`Collect` asks for (gradients, memory, parameters), as the dict tests and benchmarks read."""

from __future__ import annotations

import torch

from megatron_mllm.runtime.assembly.optimizer import sub_optimizers


def run_result(run) -> dict:
    """Everything `run` (an ExecutorRun) measured and computed so far (collective where
    parameters are collected: every rank calls it)."""
    out = {
        "replanned": run.replanned is not None,
        "replan_times": run.replanned[2] if run.replanned is not None else None,
        "replan_predicted_s": _replan_predicted_s(run),
        "moved": getattr(run, "moved", 0),
        "overlapped": getattr(run, "overlapped", 0),
        "overlapped_in": getattr(run, "overlapped_in", {}),
        "deferred_products": getattr(run, "deferred_products", 0),  # the last step's
        "losses": run.history[0],
        "history": run.history,
        "mean_losses": run.mean_losses,
        "spans": run.spans,
        "seconds": run.seconds,
        "compute_seconds": run.compute_seconds,
        "dp_seconds": run.dp_seconds,
        "breakdowns": [b.as_dict() for b in run.breakdowns],
        "optimizers": [type(o).__name__ for o in sub_optimizers(run.optimizer)],
        # part -> (DDP buckets, per step: buckets already reducing when its RS action ran)
        "ddp": {k: (s.buckets, s.in_flight_at_rs) for k, s in run.grad_sync.items()},
        "skipped_iterations": run.skipped_iterations,
        **(run.adaptive.result() if run.adaptive is not None else {}),
        "unit_times": run.unit_times,  # every step's measured unit and collective times
        "coords": run.groups.coords,
    }
    if run.job.collect.grads:
        out["grads"] = run.grads
    if run.saved is not None:
        from megatron_mllm.runtime.assembly.memory import model_state_bytes

        ddps = [d for sync in run.grad_sync.values() for d in sync.ddps]
        out["memory"] = model_state_bytes(run.rank_model.modules, ddps, run.optimizer)
        out["memory"]["activations"] = run.saved.peak
        if run.device.type == "cuda":  # what the allocator really held at its peak
            out["memory"]["device_peak"] = torch.cuda.max_memory_allocated(run.device)
    if run.job.collect.params:
        from megatron_mllm.models.weights import param_shards

        run.sync_params()
        c = run.groups.coords
        out["params"] = {k: v for m in run.chunks for k, v in param_shards(m, c.tp).items()}
        enc_tp = c.tp if run.stage0 else c.enc_tp
        for encoder in (e for e in run.encoders if e is not None):
            out["params"].update(param_shards(encoder, enc_tp))
    return out


def _replan_predicted_s(run) -> float | None:
    """The simulator's step time for the re-planned schedule under the measured times."""
    if run.replanned is None:
        return None
    from megatron_mllm.schedule.simulator import simulate

    return simulate(run.replanned[0], run.replanned[1]).step_time_s

"""`--timing-log-level`: where each rank's steps went since the last log line, in Megatron's
timer format (its `(min, max) time across ranks (ms):` block), from the executor's per-step
breakdown (`runtime/engine/breakdown.py`): compute, message waits, unhidden DP/TP communication,
encoder fills and the executor's host overhead. Level 2 adds each rank's longest waits by
message."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_mllm.runtime.engine.breakdown import StepBreakdown, summary

# summary() key -> the timer name printed (Megatron's dash-separated style)
TIMERS = {
    "seconds": "step",
    "compute_s": "compute",
    "wait_s": "message-wait",
    "comm_unhidden_s": "comm-unhidden",
    "fill_s": "encoder-fill",
    "overhead_s": "host-overhead",
    "overhead_per_action_s": "host-overhead-per-action",
}
TOP_WAITS = 3  # level 2: the longest waits by message, per rank


def gather_timings(steps: list[StepBreakdown], level: int, device) -> list[dict]:
    """Every rank's per-step means over `steps` (this rank's), gathered to every rank; a
    collective: all ranks call it at the same iterations."""
    mine = summary(steps)
    values = torch.tensor([float(mine.get(k, 0.0)) for k in TIMERS], dtype=torch.float64)
    values = values.to(device)
    out = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(out, values)
    ranks = [dict(zip(TIMERS, t.tolist(), strict=True)) for t in out]
    if level >= 2:
        waits = list(mine.get("wait_by_message", {}).items())[:TOP_WAITS]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, waits)
        for r, w in zip(ranks, every, strict=True):
            r["waits"] = w
    return ranks


def timing_lines(ranks: list[dict], option: str) -> str:
    """Megatron's timer block for `ranks` (gather_timings), `option` one of max, minmax, all."""
    head = {
        "max": "max time across ranks (ms):",
        "minmax": "(min, max) time across ranks (ms):",
        "all": "times across ranks (ms):",
    }[option]
    lines = [head]
    for key, name in TIMERS.items():
        ms = [1000 * r[key] for r in ranks]
        label = f"    {name} ".ljust(48, ".") + ": "
        if option == "max":
            lines.append(f"{label}{max(ms):.2f}")
        elif option == "minmax":
            lines.append(f"{label}({min(ms):.2f}, {max(ms):.2f})")
        else:
            lines.append(f"    {name}:")
            lines.extend(f"     rank {i:2d}: {v:.2f}" for i, v in enumerate(ms))
    for i, r in enumerate(ranks):
        if r.get("waits"):
            waits = ", ".join(f"{k} {1000 * v:.2f}" for k, v in r["waits"])
            lines.append(f"    rank {i:2d} longest message waits (ms per step): {waits}")
    return "\n".join(lines)

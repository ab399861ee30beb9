"""Event-driven simulation of a schedule on every rank: step time, bubbles by cause, memory.

Each rank has, per slot, a compute stream and a TP communication stream (NVLink), and one
data-parallel stream (the network) for AG/RS; p2p transfers are asynchronous. Ranks run their
lists in order: an action starts when its inputs are there and its streams are free, and a RECV
blocks the rest of its rank's list until its data has arrived. A backbone action runs its
kernels one by one: after a kernel with a TP collective, the compute stream waits for the
collective (a TP bubble) unless encoder work queued for that bubble (`@tpN`) runs in it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.actions import ENCODER_KINDS, Action
from megatron_mllm.schedule.dataflow import Dataflow, is_stage_backward_end
from megatron_mllm.schedule.keys import part_encoder
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.validator import backbone_groups
from megatron_mllm.schedule.workload import Workload

BUBBLE_CAUSES = ("pp_warmup", "pp_cooldown", "pp_other", "tp", "dp")


@dataclass(frozen=True)
class Span:
    """One interval on one rank's stream, for traces."""

    rank: int
    slot: int | None  # None: every slot of the rank
    stream: str  # "compute", "comm" (TP), "dp" or "p2p"
    action: Action
    part: str  # kernel name, or "" for the whole action
    start: float
    end: float
    category: str  # backbone, encoder, tp, dp, p2p

    @property
    def name(self) -> str:
        return f"{self.action}:{self.part}" if self.part else str(self.action)


@dataclass
class SimResult:
    step_time_s: float
    limit_s: float  # zero-bubble limit: all compute spread evenly over every GPU
    bubble_ratio: float
    bubbles_s: dict[str, float]  # mean idle seconds per GPU group, by cause
    peak_memory_bytes: float
    bubbles_by_rank_s: list[dict[str, float]] = field(default_factory=list)  # mean over slots
    activation_peaks: list[float] = field(default_factory=list)  # per rank: saved-activation peak
    spans: list[Span] = field(default_factory=list)
    action_times: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    first_backbone_start: list[float] = field(default_factory=list)
    mb_forward_start: dict[int, float] = field(default_factory=dict)  # F_i at stage 0
    mb_backward_end: dict[int, float] = field(default_factory=dict)  # B_i at stage 0

    @property
    def peak_memory_gb(self) -> float:
        return self.peak_memory_bytes / 1e9


class DeadlockError(ConfigError):
    """The simulated ranks stopped with work left."""


def simulate(
    schedule: Schedule, workload: Workload, keep_spans: bool = True, classify: bool = True
) -> SimResult:
    """Run `schedule` with `workload`'s costs. The schedule should already be validated.
    `classify=False` skips sorting idle time by cause (bubble fields stay 0; faster)."""
    meta = schedule.meta
    workload.check_matches(meta)
    flow = Dataflow(meta, schedule.encoder_assignment())
    n, slots = meta.pp, meta.slots
    cfree = [[0.0] * slots for _ in range(n)]
    mfree = [[0.0] * slots for _ in range(n)]
    dpfree = [0.0] * n
    cursor = [0.0] * n  # nothing later in a rank's list starts before its last RECV completed
    avail: list[dict[str, float]] = [dict() for _ in range(n)]
    arrival: dict[str, float] = {}
    spans: list[Span] = []
    times: dict[tuple[int, int], tuple[float, float]] = {}
    tp_gaps: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    mem_events: list[list[tuple[float, int | None, float]]] = [[] for _ in range(n)]
    compute_total = 0.0
    busy = [[[] for _ in range(slots)] for _ in range(n)]  # encoder compute, per slot
    backbone_busy: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # whole actions
    dp_spans: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    first_bb, last_bb = [math.inf] * n, [0.0] * n

    def span(r, slot, stream, action, part, a, b, cat):
        if stream == "compute" and slot is not None:
            busy[r][slot].append((a, b))
        elif stream == "dp":
            dp_spans[r].append((a, b))
        if keep_spans:
            spans.append(Span(r, slot, stream, action, part, a, b, cat))

    def ready(r: int, keys: list[str]) -> float:
        return max((avail[r][k] for k in keys), default=0.0)

    def dp_times(r: int, step: int, a: Action, needs: list[str]) -> tuple[float, float]:
        """Start and end of a DP action. A reduce-scatter in K buckets: bucket k is ready
        when the part's last backward on this rank is k/K done; the buckets go one after
        another on the DP stream, each taking 1/K of the time."""
        seconds = workload.dp_s.get((r, a.kind, a.key), 0.0)
        done = ready(r, needs)
        k = workload.dp_buckets.get((r, a.key), 1) if a.kind == "RS" else 1
        last = last_backward(r, step, a.key) if k > 1 else None
        if last is None:
            t0 = max(cursor[r], dpfree[r], done)
            return t0, t0 + seconds
        begin, end = last
        t = start = max(dpfree[r], begin + (end - begin) / k)
        for j in range(1, k + 1):
            t = max(t, begin + j * (end - begin) / k) + seconds / k
        return start, t

    def last_backward(r: int, step: int, part: str) -> tuple[float, float] | None:
        """(start, end) of the latest-ending backward of `part` before `step` on rank r."""
        e = part_encoder(part)
        spans_of = [
            times[(r, i)]
            for i, b in enumerate(schedule.ranks[r][:step])
            if (r, i) in times
            and ((e is None and b.kind == "B") or (b.kind in ("EB", "EW") and b.enc == e))
        ]
        return max(spans_of, key=lambda t: t[1], default=None)

    def run_encoder(r: int, step: int, a: Action, not_before: float) -> float:
        """Run one encoder chunk; return when its compute stream part ends."""
        nonlocal compute_total
        slot = flow.slot(a)
        kernels = workload.kernels(a.kind, a.stage, enc=a.enc, mb=a.mb)[a.k0 : a.k1]
        t = start = max(not_before, cursor[r], cfree[r][slot], ready(r, flow.needs(a)))
        compute_end = t
        for k in kernels:
            span(r, slot, "compute", a, k.name, t, t + k.compute_s, "encoder")
            t += k.compute_s
            compute_total += k.compute_s
            compute_end = t
            if k.comm_s > 0:
                cs = max(t, mfree[r][slot])
                mfree[r][slot] = cs + k.comm_s
                span(r, slot, "comm", a, k.name, cs, cs + k.comm_s, "tp")
                t = cs + k.comm_s
        cfree[r][slot] = compute_end
        for key in flow.makes(a):
            avail[r][key] = t
        times[(r, step)] = (start, t)
        enc = meta.encoders[a.enc]
        stage_bytes = workload.encoder_stage_bytes(a.enc, a.stage, a.mb)
        if not meta.trains(a.mb):  # a look-ahead forward saves nothing for a backward
            return compute_end
        if a.kind == "EF":
            share = stage_bytes * (a.k1 - a.k0) / enc.fwd_kernels[a.stage]
            mem_events[r].append((start, slot, share))
            if enc.bwd_kernels[a.stage] == 0:  # nothing will run backward: freed at once
                mem_events[r].append((t, slot, -share))
        elif is_stage_backward_end(enc, a):  # a split one keeps them for its weight gradients
            mem_events[r].append((t, slot, -stage_bytes))
        return compute_end

    def run_backbone(r: int, group: list[int], acts: list[Action]) -> None:
        nonlocal compute_total
        step = group[-1]
        a = acts[step]
        fills = defaultdict(list)
        for i in group[:-1]:
            fills[acts[i].fill].append(i)
        kernels = workload.kernels(a.kind, a.stage, a.chunk, mb=a.mb)
        start = max(cursor[r], max(cfree[r]), ready(r, flow.needs(a)))
        t = start + workload.chunk_overhead_s
        gap = 0
        for k in kernels:
            if keep_spans:
                span(r, None, "compute", a, k.name, t, t + k.compute_s, "backbone")
            t += k.compute_s
            compute_total += k.compute_s * slots
            if k.comm_s > 0:
                cs = max(t, max(mfree[r]))
                ce = cs + k.comm_s
                for s in range(slots):
                    mfree[r][s] = ce
                if keep_spans:
                    span(r, None, "comm", a, k.name, cs, ce, "tp")
                tp_gaps[r].append((t, ce))
                resume = ce
                for i in fills.pop(gap, []):
                    resume = max(resume, run_encoder(r, i, acts[i], t))
                t = resume
                gap += 1
        if fills:
            bad = min(i for idx in fills.values() for i in idx)
            raise ConfigError(
                f"rank {r}, step {bad}: {acts[bad]} fills TP bubble {acts[bad].fill} but "
                f"{a} has only {gap} TP bubble(s)"
            )
        for s in range(slots):
            cfree[r][s] = t
        for key in flow.makes(a):
            avail[r][key] = t
        times[(r, step)] = (start, t)
        backbone_busy[r].append((start, t))
        first_bb[r] = min(first_bb[r], start)
        last_bb[r] = max(last_bb[r], t)
        nbytes = workload.backbone_act_bytes.get((a.stage, a.chunk), 0.0)
        if meta.trains(a.mb):  # a look-ahead forward saves nothing for a backward
            mem_events[r].append((start, None, nbytes) if a.kind == "F" else (t, None, -nbytes))

    groups = [backbone_groups(acts) for acts in schedule.ranks]
    ptr = [0] * n
    while True:
        progressed = False
        for r, acts in enumerate(schedule.ranks):
            while ptr[r] < len(groups[r]):
                group = groups[r][ptr[r]]
                a = acts[group[-1]]
                if a.kind == "RECV" and a.key not in arrival:
                    break
                if a.kind in ("F", "B"):
                    run_backbone(r, group, acts)
                elif a.kind in ENCODER_KINDS:
                    run_encoder(r, group[-1], a, 0.0)
                elif a.kind == "SEND":
                    t0 = max(cursor[r], avail[r][a.key])
                    arrival[a.key] = t0 + workload.transfer_time(a.key)
                    span(r, None, "p2p", a, "", t0, arrival[a.key], "p2p")
                    times[(r, group[-1])] = (t0, arrival[a.key])
                elif a.kind == "RECV":
                    avail[r][a.key] = arrival[a.key]
                    cursor[r] = max(cursor[r], arrival[a.key])
                    times[(r, group[-1])] = (arrival[a.key], arrival[a.key])
                else:  # AG / RS on the rank's data-parallel stream
                    needs = flow.rs_needs(r, acts, a.key) if a.kind == "RS" else []
                    t0, t1 = dp_times(r, group[-1], a, needs)
                    dpfree[r] = t1
                    for key in flow.makes(a):
                        avail[r][key] = t1
                    span(r, None, "dp", a, "", t0, t1, "dp")
                    times[(r, group[-1])] = (t0, t1)
                ptr[r] += 1
                progressed = True
        if all(ptr[r] == len(groups[r]) for r in range(n)):
            break
        if not progressed:
            stuck = ", ".join(
                f"rank {r} waits at step {groups[r][ptr[r]][-1]} "
                f"({schedule.ranks[r][groups[r][ptr[r]][-1]]})"
                for r in range(n)
                if ptr[r] < len(groups[r])
            )
            raise DeadlockError(f"simulation deadlocked: {stuck}")

    step_time = max((b for _, b in times.values()), default=0.0)
    first_bb = [min(f, step_time) for f in first_bb]
    causes = dict.fromkeys(BUBBLE_CAUSES, 0.0)
    by_rank = [dict.fromkeys(BUBBLE_CAUSES, 0.0) for _ in range(n)]
    for r in range(n) if classify else ():
        for slot in range(slots):
            for cause, seconds in _classify_idle(
                busy[r][slot],
                backbone_busy[r],
                tp_gaps[r],
                dp_spans[r],
                first_bb[r],
                last_bb[r],
                step_time,
            ).items():
                causes[cause] += seconds
                by_rank[r][cause] += seconds / slots
    groups = n * slots
    idle_total = sum(causes.values())
    peak, activation_peaks = 0.0, []
    for r in range(n):
        level = [0.0] * slots
        top = 0.0
        for _, slot, delta in sorted(mem_events[r], key=lambda e: (e[0], e[2])):
            for s in range(slots) if slot is None else [slot]:
                level[s] += delta
            top = max(top, max(level))
        state = workload.state_bytes[r] if workload.state_bytes else 0.0
        peak = max(peak, state + top)
        activation_peaks.append(top)
    f_start, b_end = {}, {}
    for (r, step), (a, b) in times.items():
        act = schedule.ranks[r][step]
        if act.kind == "F" and act.stage == 0 and act.chunk == 0:
            f_start[act.mb] = a
        if act.kind == "B" and act.stage == 0 and act.chunk == 0:
            b_end[act.mb] = b
    return SimResult(
        step_time_s=step_time,
        limit_s=compute_total / groups,
        bubble_ratio=idle_total / (groups * step_time) if step_time else 0.0,
        bubbles_s={k: v / groups for k, v in causes.items()},
        bubbles_by_rank_s=by_rank,
        peak_memory_bytes=peak,
        activation_peaks=activation_peaks,
        spans=spans,
        action_times=times,
        first_backbone_start=first_bb,
        mb_forward_start=f_start,
        mb_backward_end=b_end,
    )


def _covered(mids: np.ndarray, intervals: list[tuple[float, float]]) -> np.ndarray:
    """For each point, whether any of the (possibly overlapping) intervals covers it."""
    if not intervals:
        return np.zeros(len(mids), dtype=bool)
    arr = np.asarray(intervals)
    starts, ends = np.sort(arr[:, 0]), np.sort(arr[:, 1])
    return np.searchsorted(starts, mids, "right") > np.searchsorted(ends, mids, "right")


def _classify_idle(encoder, backbone, tp_gaps, dp, first, last, step_time) -> dict[str, float]:
    """Idle compute time of one GPU group in [0, step_time), split by cause.

    Busy: encoder compute, and backbone actions less their TP bubbles. TP bubbles first (idle
    inside a backbone action), then DP (idle while AG/RS run), then by position: before the
    first backbone compute (warm-up), after the last (cool-down), other.
    """
    points = [0.0, step_time, first, last]
    for group in (encoder, backbone, tp_gaps, dp):
        for a, b in group:
            points += [a, b]
    pts = np.unique(np.clip(np.asarray(points), 0.0, step_time))
    if len(pts) < 2:
        return {}
    mids, lengths = (pts[:-1] + pts[1:]) / 2, np.diff(pts)
    in_tp = _covered(mids, tp_gaps)
    idle = ~(_covered(mids, encoder) | (_covered(mids, backbone) & ~in_tp))
    tp = idle & in_tp
    dpc = idle & ~tp & _covered(mids, dp)
    rest = idle & ~tp & ~dpc
    warm, cool = rest & (mids < first), rest & (mids > last)
    return {
        "tp": float(lengths[tp].sum()),
        "dp": float(lengths[dpc].sum()),
        "pp_warmup": float(lengths[warm].sum()),
        "pp_cooldown": float(lengths[cool].sum()),
        "pp_other": float(lengths[rest & ~warm & ~cool].sum()),
    }

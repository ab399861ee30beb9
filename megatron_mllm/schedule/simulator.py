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
from operator import itemgetter

import numpy as np

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.actions import ENCODER_KINDS, Action
from megatron_mllm.schedule.dataflow import dataflow_of, is_stage_backward_end
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


def _rendezvous_times(rendezvous: list, workload: Workload, times: dict) -> list[tuple]:
    """(rank, step, action, start, end) of reduce-scatters whose DP group spans simulated
    ranks: one ends no earlier than its peers' (a collective finishes when its slowest member
    does), and a rank's later ones queue behind it on its DP stream."""
    local_end = {(r, a.key): times[(r, step)][1] for r, step, a in rendezvous}
    out, free = [], {}
    for r, step, a in sorted(rendezvous, key=lambda x: (x[0], times[(x[0], x[1])][0])):
        t0, t1 = times[(r, step)]
        peers = workload.dp_peers[(r, a.key)]
        synced = max(local_end.get((q, a.key), t1) for q in peers)
        end = max(synced, free.get(r, 0.0) + (t1 - t0))
        free[r] = end
        out.append((r, step, a, t0, end))
    return out


class DeadlockError(ConfigError):
    """The simulated ranks stopped with work left."""


def simulate(
    schedule: Schedule, workload: Workload, keep_spans: bool = True, classify: bool = True
) -> SimResult:
    """Run `schedule` with `workload`'s costs. The schedule should already be validated.
    `classify=False` skips sorting idle time by cause (bubble fields stay 0; faster)."""
    meta = schedule.meta
    workload.check_matches(meta)
    flow = dataflow_of(meta, schedule.encoder_assignment())
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
    # Per rank, per encoder (None: the backbone): (start, end) of the latest-ending backward
    # run so far (a stage's last backward kernels end after its others).
    last_bwd: list[dict[int | None, tuple[float, float]]] = [{} for _ in range(n)]
    f_start: dict[int, float] = {}  # micro-batch -> start of its first backbone forward
    b_end: dict[int, float] = {}  # micro-batch -> end of its last backbone backward

    def backward_ran(r: int, part: int | None, start: float, end: float) -> None:
        if end > last_bwd[r].get(part, (0.0, -1.0))[1]:
            last_bwd[r][part] = (start, end)

    def span(r, slot, stream, action, part, a, b, cat):
        if not (keep_spans or classify):
            return
        if stream == "compute" and slot is not None:
            busy[r][slot].append((a, b))
        elif stream == "dp":
            dp_spans[r].append((a, b))
        if keep_spans:
            spans.append(Span(r, slot, stream, action, part, a, b, cat))

    def ready(r: int, keys: list[str]) -> float:
        have, t = avail[r], 0.0
        for k in keys:
            if have[k] > t:
                t = have[k]
        return t

    def dp_times(r: int, a: Action) -> tuple[float, float]:
        """Start and end of a DP action. A reduce-scatter waits for every backward of its part
        on the rank (the latest-ending one, as the rank's list has run up to it); in K buckets,
        bucket k is ready when that backward is k/K done, and the buckets go one after another
        on the DP stream, each taking 1/K of the time."""
        seconds = workload.dp_s.get((r, a.kind, a.key), 0.0)
        last = last_bwd[r].get(part_encoder(a.key)) if a.kind == "RS" else None
        k = workload.dp_buckets.get((r, a.key), 1) if last is not None else 1
        if k == 1:
            t0 = max(cursor[r], dpfree[r], last[1] if last else 0.0)
            return t0, t0 + seconds
        begin, end = last
        t = start = max(dpfree[r], begin + (end - begin) / k)
        for j in range(1, k + 1):
            t = max(t, begin + j * (end - begin) / k) + seconds / k
        return start, t

    def run_encoder(r: int, step: int, a: Action, not_before: float) -> float:
        """Run one encoder chunk; return when its compute stream part ends."""
        nonlocal compute_total
        slot = flow.slot(a)
        kernels = workload.kernels(a.kind, a.stage, enc=a.enc, mb=a.mb)[a.k0 : a.k1]
        t = start = max(not_before, cursor[r], cfree[r][slot], ready(r, flow.needs(a)))
        t += workload.encoder_overhead_s
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
        if a.kind in ("EB", "EW"):
            backward_ran(r, a.enc, start, t)
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
        fills = defaultdict(list) if len(group) > 1 else {}
        for i in group[:-1]:
            fills[acts[i].fill].append(i)
        kernels = workload.kernels(a.kind, a.stage, a.chunk, mb=a.mb)
        cf, mf = cfree[r], mfree[r]
        start = max(cursor[r], max(cf), ready(r, flow.needs(a)))
        t = start + workload.chunk_overhead_s
        # The TP stream is the rank's: after a backbone collective every slot's is free at its
        # end (`mf` is written back lazily), unless a fill's own collective runs later.
        comm_free, written, work, gap = max(mf), True, 0.0, 0
        for k in kernels:
            if keep_spans:
                span(r, None, "compute", a, k.name, t, t + k.compute_s, "backbone")
            t += k.compute_s
            work += k.compute_s
            if k.comm_s > 0:
                cs = t if t > comm_free else comm_free
                comm_free = ce = cs + k.comm_s
                written = False
                if keep_spans:
                    span(r, None, "comm", a, k.name, cs, ce, "tp")
                if classify:
                    tp_gaps[r].append((t, ce))
                resume = ce
                if gap in fills:
                    mf[:] = [ce] * slots
                    for i in fills.pop(gap):
                        resume = max(resume, run_encoder(r, i, acts[i], t))
                    comm_free, written = max(mf), True
                t = resume
                gap += 1
        if not written:
            mf[:] = [comm_free] * slots
        compute_total += work * slots
        if fills:
            bad = min(i for idx in fills.values() for i in idx)
            raise ConfigError(
                f"rank {r}, step {bad}: {acts[bad]} fills TP bubble {acts[bad].fill} but "
                f"{a} has only {gap} TP bubble(s)"
            )
        cf[:] = [t] * slots
        for key in flow.makes(a):
            avail[r][key] = t
        times[(r, step)] = (start, t)
        if a.kind == "B":
            backward_ran(r, None, start, t)
        if a.stage == 0 and a.chunk == 0:  # F_i and B_i, as the bubble scheduler names them
            (f_start if a.kind == "F" else b_end)[a.mb] = start if a.kind == "F" else t
        backbone_busy[r].append((start, t))
        first_bb[r] = min(first_bb[r], start)
        last_bb[r] = max(last_bb[r], t)
        nbytes = workload.backbone_act_bytes.get((a.stage, a.chunk), 0.0)
        if meta.trains(a.mb):  # a look-ahead forward saves nothing for a backward
            mem_events[r].append((start, None, nbytes) if a.kind == "F" else (t, None, -nbytes))

    groups = [backbone_groups(acts) for acts in schedule.ranks]
    ptr = [0] * n
    rendezvous: list[tuple[int, int, Action]] = []  # reduce-scatters shared between ranks
    transfer_time = workload.transfer_time
    while True:
        progressed = False
        for r, acts in enumerate(schedule.ranks):
            mine, p, have = groups[r], ptr[r], avail[r]
            while p < len(mine):
                group = mine[p]
                step = group[-1]
                a = acts[step]
                kind = a.kind
                if kind == "F" or kind == "B":
                    run_backbone(r, group, acts)
                elif kind == "SEND":
                    t0 = max(cursor[r], have[a.key])
                    arrival[a.key] = t1 = t0 + transfer_time(a.key)
                    span(r, None, "p2p", a, "", t0, t1, "p2p")
                    times[(r, step)] = (t0, t1)
                elif kind == "RECV":
                    t1 = arrival.get(a.key)
                    if t1 is None:
                        break  # not sent yet
                    have[a.key] = t1
                    cursor[r] = max(cursor[r], t1)
                    times[(r, step)] = (t1, t1)
                elif kind in ENCODER_KINDS:
                    run_encoder(r, step, a, 0.0)
                else:  # AG / RS on the rank's data-parallel stream
                    t0, t1 = dp_times(r, a)
                    dpfree[r] = t1
                    for key in flow.makes(a):
                        have[key] = t1
                    times[(r, step)] = (t0, t1)
                    if a.kind == "RS" and (r, a.key) in workload.dp_peers:
                        rendezvous.append((r, step, a))  # its span once its peers are known
                    else:
                        span(r, None, "dp", a, "", t0, t1, "dp")
                p += 1
            progressed = progressed or p > ptr[r]
            ptr[r] = p
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

    for r, step, a, t0, t1 in _rendezvous_times(rendezvous, workload, times):
        times[(r, step)] = (t0, t1)
        span(r, None, "dp", a, "", t0, t1, "dp")
    step_time = max(map(itemgetter(1), times.values()), default=0.0)
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

"""Event-driven simulation of a schedule on every rank: step time, bubbles by cause, memory.

Each rank has, per slot, a compute stream and a TP communication stream (NVLink), and one
data-parallel stream (the network) for AG/RS; p2p transfers are asynchronous. Ranks run their
lists in order: an action starts when its inputs are there and its streams are free, and a RECV
blocks the rest of its rank's list until its data has arrived. A SEND departs once its tensor is
made and its GPU's compute stream has reached it in the list (NCCL's stream waits for the work
queued before it; our CPU executor runs the list in order). A backbone action runs its
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
    workload.check_matches(schedule.meta)
    sim = _Simulation(schedule, workload, keep_spans, classify)
    sim.run_lists()
    return sim.result()


class _Simulation:
    """The state of one simulated step: per rank and slot, when each stream is free, which
    tensors are there, what ran when, and the memory and idle-time records."""

    def __init__(self, schedule: Schedule, workload: Workload, keep_spans: bool, classify: bool):
        meta = schedule.meta
        self.schedule, self.meta, self.workload = schedule, meta, workload
        self.keep_spans, self.classify = keep_spans, classify
        self.flow = dataflow_of(meta, schedule.encoder_assignment())
        n, slots = self.n, self.slots = meta.pp, meta.slots
        self.cfree = [[0.0] * slots for _ in range(n)]
        self.mfree = [[0.0] * slots for _ in range(n)]
        self.dpfree = [0.0] * n
        self.cursor = [0.0] * n  # nothing later in a rank's list starts before its last RECV
        self.avail: list[dict[str, float]] = [dict() for _ in range(n)]
        self.made_on: list[dict[str, int]] = [dict() for _ in range(n)]  # encoder key -> slot
        self.arrival: dict[str, float] = {}
        self.spans: list[Span] = []
        self.times: dict[tuple[int, int], tuple[float, float]] = {}
        self.tp_gaps: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.mem_events: list[list[tuple[float, int | None, float]]] = [[] for _ in range(n)]
        self.compute_total = 0.0
        self.busy = [[[] for _ in range(slots)] for _ in range(n)]  # encoder compute, per slot
        self.backbone_busy: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.dp_spans: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.first_bb, self.last_bb = [math.inf] * n, [0.0] * n
        # Per rank, per encoder (None: the backbone): (start, end) of the latest-ending
        # backward run so far (a stage's last backward kernels end after its others).
        self.last_bwd: list[dict[int | None, tuple[float, float]]] = [{} for _ in range(n)]
        self.f_start: dict[int, float] = {}  # micro-batch -> start of its first backbone F
        self.b_end: dict[int, float] = {}  # micro-batch -> end of its last backbone B
        self.rendezvous: list[tuple[int, int, Action]] = []  # RS shared between ranks

    def backward_ran(self, r: int, part: int | None, start: float, end: float) -> None:
        if end > self.last_bwd[r].get(part, (0.0, -1.0))[1]:
            self.last_bwd[r][part] = (start, end)

    def span(self, r, slot, stream, action, part, a, b, cat) -> None:
        if not (self.keep_spans or self.classify):
            return
        if stream == "compute" and slot is not None:
            self.busy[r][slot].append((a, b))
        elif stream == "dp":
            self.dp_spans[r].append((a, b))
        if self.keep_spans:
            self.spans.append(Span(r, slot, stream, action, part, a, b, cat))

    def ready(self, r: int, keys: list[str]) -> float:
        have, t = self.avail[r], 0.0
        for k in keys:
            if have[k] > t:
                t = have[k]
        return t

    def dp_times(self, r: int, a: Action) -> tuple[float, float]:
        """Start and end of a DP action. A reduce-scatter waits for every backward of its part
        on the rank (the latest-ending one, as the rank's list has run up to it); in K buckets,
        bucket k is ready when that backward is k/K done, and the buckets go one after another
        on the DP stream, each taking 1/K of the time."""
        workload = self.workload
        seconds = workload.dp_s.get((r, a.kind, a.key), 0.0)
        last = self.last_bwd[r].get(part_encoder(a.key)) if a.kind == "RS" else None
        k = workload.dp_buckets.get((r, a.key), 1) if last is not None else 1
        if k == 1:
            t0 = max(self.cursor[r], self.dpfree[r], last[1] if last else 0.0)
            return t0, t0 + seconds
        begin, end = last
        t = start = max(self.dpfree[r], begin + (end - begin) / k)
        for j in range(1, k + 1):
            t = max(t, begin + j * (end - begin) / k) + seconds / k
        return start, t

    def run_encoder(self, r: int, step: int, a: Action, not_before: float) -> float:
        """Run one encoder chunk; return when its compute stream part ends."""
        flow, workload, span, cfree, mfree = (
            self.flow,
            self.workload,
            self.span,
            self.cfree,
            self.mfree,
        )
        slot = flow.slot(a)
        kernels = workload.kernels(a.kind, a.stage, enc=a.enc, mb=a.mb)[a.k0 : a.k1]
        t = start = max(not_before, self.cursor[r], cfree[r][slot], self.ready(r, flow.needs(a)))
        t += workload.encoder_overhead_s
        compute_end = t
        for k in kernels:
            span(r, slot, "compute", a, k.name, t, t + k.compute_s, "encoder")
            t += k.compute_s
            self.compute_total += k.compute_s
            compute_end = t
            if k.comm_s > 0:
                cs = max(t, mfree[r][slot])
                mfree[r][slot] = cs + k.comm_s
                span(r, slot, "comm", a, k.name, cs, cs + k.comm_s, "tp")
                t = cs + k.comm_s
        cfree[r][slot] = compute_end
        made_on = self.made_on[r]
        for key in flow.makes(a):
            self.avail[r][key] = t
            made_on[key] = slot
        self.times[(r, step)] = (start, t)
        if a.kind in ("EB", "EW"):
            self.backward_ran(r, a.enc, start, t)
        if self.meta.trains(a.mb):  # a look-ahead forward saves nothing for a backward
            self._encoder_memory(r, slot, a, start, t)
        return compute_end

    def _encoder_memory(self, r: int, slot: int, a: Action, start: float, end: float) -> None:
        enc = self.meta.encoders[a.enc]
        stage_bytes = self.workload.encoder_stage_bytes(a.enc, a.stage, a.mb)
        events = self.mem_events[r]
        if a.kind == "EF":
            share = stage_bytes * (a.k1 - a.k0) / enc.fwd_kernels[a.stage]
            events.append((start, slot, share))
            if enc.bwd_kernels[a.stage] == 0:  # nothing will run backward: freed at once
                events.append((end, slot, -share))
        elif is_stage_backward_end(enc, a):  # a split one keeps them for its weight gradients
            events.append((end, slot, -stage_bytes))

    def run_backbone(self, r: int, group: list[int], acts: list[Action]) -> None:
        """One backbone action (the group's last) with the encoder fills queued for its TP
        bubbles (the group's others), kernel by kernel."""
        keep_spans, classify, span, slots = self.keep_spans, self.classify, self.span, self.slots
        step = group[-1]
        a = acts[step]
        fills = defaultdict(list) if len(group) > 1 else {}
        for i in group[:-1]:
            fills[acts[i].fill].append(i)
        split = a.kind == "B" and self.meta.splits_backbone(a)
        kernels = self.workload.kernels(a.kind, a.stage, a.chunk, mb=a.mb, split=split)
        cf, mf = self.cfree[r], self.mfree[r]
        start = max(self.cursor[r], max(cf), self.ready(r, self.flow.needs(a)))
        t = start + self.workload.chunk_overhead_s
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
                    self.tp_gaps[r].append((t, ce))
                resume = ce
                if gap in fills:
                    mf[:] = [ce] * slots
                    for i in fills.pop(gap):
                        resume = max(resume, self.run_encoder(r, i, acts[i], t))
                    comm_free, written = max(mf), True
                t = resume
                gap += 1
        if not written:
            mf[:] = [comm_free] * slots
        self.compute_total += work * slots
        if fills:
            bad = min(i for idx in fills.values() for i in idx)
            raise ConfigError(
                f"rank {r}, step {bad}: {acts[bad]} fills TP bubble {acts[bad].fill} but "
                f"{a} has only {gap} TP bubble(s)"
            )
        cf[:] = [t] * slots
        self._backbone_ran(r, step, a, start, t)

    def _backbone_ran(self, r: int, step: int, a: Action, start: float, end: float) -> None:
        for key in self.flow.makes(a):
            self.avail[r][key] = end
        self.times[(r, step)] = (start, end)
        if a.kind != "F":
            self.backward_ran(r, None, start, end)
        if a.stage == 0 and a.chunk == 0:  # F_i and B_i, as the bubble scheduler names them
            if a.kind == "F":
                self.f_start[a.mb] = start
            elif a.kind == "B":
                self.b_end[a.mb] = end
        self.backbone_busy[r].append((start, end))
        self.first_bb[r] = min(self.first_bb[r], start)
        self.last_bb[r] = max(self.last_bb[r], end)
        nbytes = self.workload.backbone_act_bytes.get((a.stage, a.chunk), 0.0)
        if self.meta.trains(a.mb):  # a look-ahead forward saves nothing for a backward
            if a.kind == "F":
                self.mem_events[r].append((start, None, nbytes))
            elif a.kind == "W" or not self.meta.splits_backbone(a):  # W reads the inputs
                self.mem_events[r].append((end, None, -nbytes))

    def run_lists(self) -> None:
        """Every rank's list, in order, round after round until all are done (DeadlockError
        where a round makes no progress)."""
        ranks = self.schedule.ranks
        groups = [backbone_groups(acts) for acts in ranks]
        ptr = [0] * self.n
        while True:
            progressed = False
            for r, acts in enumerate(ranks):
                p = self._run_rank(r, acts, groups[r], ptr[r])
                progressed = progressed or p > ptr[r]
                ptr[r] = p
            if all(ptr[r] == len(groups[r]) for r in range(self.n)):
                break
            if not progressed:
                stuck = ", ".join(
                    f"rank {r} waits at step {groups[r][ptr[r]][-1]} "
                    f"({ranks[r][groups[r][ptr[r]][-1]]})"
                    for r in range(self.n)
                    if ptr[r] < len(groups[r])
                )
                raise DeadlockError(f"simulation deadlocked: {stuck}")
        for r, step, a, t0, t1 in _rendezvous_times(self.rendezvous, self.workload, self.times):
            self.times[(r, step)] = (t0, t1)
            self.span(r, None, "dp", a, "", t0, t1, "dp")

    def _run_rank(self, r: int, acts: list[Action], mine: list[list[int]], p: int) -> int:
        """Rank r's list from group `p` until a RECV whose message is not sent yet; returns
        where it stopped."""
        have, times, cursor, arrival = self.avail[r], self.times, self.cursor, self.arrival
        while p < len(mine):
            group = mine[p]
            step = group[-1]
            a = acts[step]
            kind = a.kind
            if kind == "F" or kind == "B" or kind == "W":
                self.run_backbone(r, group, acts)
            elif kind == "SEND":
                slot = self.made_on[r].get(a.key)
                cf = self.cfree[r]
                t0 = max(cursor[r], have[a.key], max(cf) if slot is None else cf[slot])
                arrival[a.key] = t1 = t0 + self.workload.transfer_time(a.key)
                self.span(r, None, "p2p", a, "", t0, t1, "p2p")
                times[(r, step)] = (t0, t1)
            elif kind == "RECV":
                t1 = arrival.get(a.key)
                if t1 is None:
                    break  # not sent yet
                have[a.key] = t1
                cursor[r] = max(cursor[r], t1)
                times[(r, step)] = (t1, t1)
            elif kind in ENCODER_KINDS:
                self.run_encoder(r, step, a, 0.0)
            else:
                self._run_dp(r, step, a)
            p += 1
        return p

    def _run_dp(self, r: int, step: int, a: Action) -> None:
        """AG / RS on the rank's data-parallel stream."""
        t0, t1 = self.dp_times(r, a)
        self.dpfree[r] = t1
        for key in self.flow.makes(a):
            self.avail[r][key] = t1
        self.times[(r, step)] = (t0, t1)
        if a.kind == "RS" and (r, a.key) in self.workload.dp_peers:
            self.rendezvous.append((r, step, a))  # its span once its peers are known
        else:
            self.span(r, None, "dp", a, "", t0, t1, "dp")

    def result(self) -> SimResult:
        step_time = max(map(itemgetter(1), self.times.values()), default=0.0)
        first_bb = [min(f, step_time) for f in self.first_bb]
        causes, by_rank = self._idle_by_cause(first_bb, step_time)
        groups = self.n * self.slots
        peak, activation_peaks = self._memory_peaks()
        return SimResult(
            step_time_s=step_time,
            limit_s=self.compute_total / groups,
            bubble_ratio=sum(causes.values()) / (groups * step_time) if step_time else 0.0,
            bubbles_s={k: v / groups for k, v in causes.items()},
            bubbles_by_rank_s=by_rank,
            peak_memory_bytes=peak,
            activation_peaks=activation_peaks,
            spans=self.spans,
            action_times=self.times,
            first_backbone_start=first_bb,
            mb_forward_start=self.f_start,
            mb_backward_end=self.b_end,
        )

    def _idle_by_cause(self, first_bb: list[float], step_time: float) -> tuple[dict, list]:
        """Idle compute time by cause, over all ranks' slots and per rank (per slot)."""
        causes = dict.fromkeys(BUBBLE_CAUSES, 0.0)
        by_rank = [dict.fromkeys(BUBBLE_CAUSES, 0.0) for _ in range(self.n)]
        for r in range(self.n) if self.classify else ():
            for slot in range(self.slots):
                for cause, seconds in _classify_idle(
                    self.busy[r][slot],
                    self.backbone_busy[r],
                    self.tp_gaps[r],
                    self.dp_spans[r],
                    first_bb[r],
                    self.last_bb[r],
                    step_time,
                ).items():
                    causes[cause] += seconds
                    by_rank[r][cause] += seconds / self.slots
        return causes, by_rank

    def _memory_peaks(self) -> tuple[float, list[float]]:
        """The highest rank's model state plus activations, and each rank's activation peak."""
        state_bytes = self.workload.state_bytes
        peak, activation_peaks = 0.0, []
        for r in range(self.n):
            level = [0.0] * self.slots
            top = 0.0
            for _, slot, delta in sorted(self.mem_events[r], key=lambda e: (e[0], e[2])):
                for s in range(self.slots) if slot is None else [slot]:
                    level[s] += delta
                top = max(top, max(level))
            peak = max(peak, (state_bytes[r] if state_bytes else 0.0) + top)
            activation_peaks.append(top)
        return peak, activation_peaks


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

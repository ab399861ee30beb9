"""Where a step's time goes, per rank: compute, waits on messages, unhidden DP and TP
communication, fills, and the executor's own overhead (time inside the step covered by no span:
between one action's end and the next one's start, not waiting for anything).

From our executor's trace spans (`breakdown_of_spans`), and for megatron-core's own schedule from
marks around its forward and backward steps, its point-to-point calls and its finalize
(`ScheduleTimer`, which only times upstream's functions and changes nothing they do). On a GPU
every mark is a CUDA event, so "overhead" is device time in which nothing ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measure(intervals: Iterable[Interval]) -> float:
    """Seconds covered by `intervals` (overlaps counted once)."""
    return sum(b - a for a, b in union(intervals))


def minus(keep: Iterable[Interval], cut: Iterable[Interval]) -> list[Interval]:
    """The parts of `keep` outside every interval of `cut`."""
    out, cuts = [], union(cut)
    for a, b in union(keep):
        for c, d in cuts:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


@dataclass
class StepBreakdown:
    """One rank's step, in seconds; `wait_by_message`: seconds per message key."""

    seconds: float
    compute_s: float  # backbone and encoder work (fills included), without unhidden TP waits
    wait_s: float  # point-to-point: posting sends and waiting for receives
    comm_unhidden_s: float  # DP all-gather / reduce-scatter and TP collective waits not filled
    fill_s: float  # encoder work run inside a backbone TP collective's wait
    overhead_s: float  # covered by none of the above
    actions: int  # compute actions and messages run (the denominator of overhead per action)
    wait_by_message: dict[str, float] = field(default_factory=dict)

    @property
    def overhead_per_action_s(self) -> float:
        return self.overhead_s / max(self.actions, 1)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["overhead_per_action_s"] = self.overhead_per_action_s
        return out


def breakdown_of_spans(spans: list, seconds: float) -> StepBreakdown:
    """A step's breakdown from our executor's spans (`Span`s of one rank, seconds since the
    step's start): compute spans nest fills and TP waits (stream "comm") inside backbone ones."""
    by_stream: dict[str, list[Interval]] = {}
    for s in spans:
        by_stream.setdefault(s.stream, []).append((s.start, s.end))
    encoder = [(s.start, s.end) for s in spans if s.category == "encoder"]
    tp = by_stream.get("comm", [])
    tp_unhidden = measure(minus(tp, encoder))
    covered = measure(x for intervals in by_stream.values() for x in intervals)
    waits: dict[str, float] = {}
    for s in spans:
        if s.stream == "p2p":
            name = f"{s.action.kind}:{s.action.key}"
            waits[name] = waits.get(name, 0.0) + (s.end - s.start)
    return StepBreakdown(
        seconds=seconds,
        compute_s=measure(by_stream.get("compute", [])) - tp_unhidden,
        wait_s=measure(by_stream.get("p2p", [])),
        comm_unhidden_s=measure(by_stream.get("dp", [])) + tp_unhidden,
        fill_s=measure(encoder) - measure(minus(encoder, tp)),
        overhead_s=max(seconds - covered, 0.0),
        actions=sum(1 for s in spans if s.stream in ("compute", "p2p")),
        wait_by_message=waits,
    )


def summary(steps: list[StepBreakdown]) -> dict:
    """Per-step means of every field (the measured steps of one rank), for reports."""
    if not steps:
        return {}
    n = len(steps)
    keys = ("seconds", "compute_s", "wait_s", "comm_unhidden_s", "fill_s", "overhead_s")
    out = {k: sum(getattr(s, k) for s in steps) / n for k in keys}
    out["actions"] = sum(s.actions for s in steps) / n
    out["overhead_per_action_s"] = out["overhead_s"] / max(out["actions"], 1)
    out["wait_by_message"] = mean_waits([s.wait_by_message for s in steps])
    return out


def mean_waits(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Each message's mean wait per step over `per_step` (waits by message; a step that did
    not wait for one counts 0), the longest first."""
    waits: dict[str, float] = {}
    for step in per_step:
        for k, v in step.items():
            waits[k] = waits.get(k, 0.0) + v / len(per_step)
    return dict(sorted(waits.items(), key=lambda kv: -kv[1]))


class ScheduleTimer:
    """Marks around megatron-core's forward_step, backward_step and point-to-point calls while
    its schedule runs (`timing(clock)`), to break its step down as ours: the functions are the
    same objects, wrapped only for the duration of the step."""

    P2P = (
        "recv_forward",
        "recv_backward",
        "send_forward",
        "send_backward",
        "send_forward_recv_backward",
        "send_backward_recv_forward",
        "send_forward_recv_forward",
        "send_backward_recv_backward",
        "send_forward_backward_recv_forward_backward",
    )

    def __init__(self) -> None:
        self.compute: list[tuple] = []
        self.p2p: list[tuple] = []
        self.microbatches = 0

    @contextlib.contextmanager
    def timing(self, clock) -> Iterator[None]:
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        self.compute, self.p2p, self.microbatches = [], [], 0
        saved = {"forward_step": schedules.forward_step, "backward_step": schedules.backward_step}
        methods = {m: getattr(P2PCommunicator, m) for m in self.P2P if hasattr(P2PCommunicator, m)}

        def timed(fn, into: list, count: bool = False):
            def wrapper(*args, **kwargs):
                start = clock.mark()
                try:
                    return fn(*args, **kwargs)
                finally:
                    into.append((start, clock.mark()))
                    self.microbatches += count

            return wrapper

        schedules.forward_step = timed(saved["forward_step"], self.compute, count=True)
        schedules.backward_step = timed(saved["backward_step"], self.compute)
        for name, fn in methods.items():
            setattr(P2PCommunicator, name, timed(fn, self.p2p))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(schedules, name, fn)
            for name, fn in methods.items():
                setattr(P2PCommunicator, name, fn)

    def breakdown(self, clock, seconds: float, dp_marks: list[tuple]) -> StepBreakdown:
        """The step's breakdown from the marks (after `clock.finish()`)."""

        def seconds_of(marks):
            return [(clock.since_start(a), clock.since_start(b)) for a, b in marks]

        compute, p2p, dp = seconds_of(self.compute), seconds_of(self.p2p), seconds_of(dp_marks)
        return StepBreakdown(
            seconds=seconds,
            compute_s=measure(compute),
            wait_s=measure(p2p),
            comm_unhidden_s=measure(dp),
            fill_s=0.0,
            overhead_s=max(seconds - measure(compute + p2p + dp), 0.0),
            actions=self.microbatches,  # per micro-batch: one forward and one backward step
        )


def busy_seconds(spans, stream: str) -> float:
    """Seconds in which `stream` had work (the union of its spans: fills run inside backbone
    actions overlap them)."""
    busy, end = 0.0, float("-inf")
    for span in sorted((s for s in spans if s.stream == stream), key=lambda s: s.start):
        if span.end > end:
            busy += span.end - max(span.start, end)
            end = span.end
    return busy

"""Where a measured step's time goes, by replaying its trace: each rank's top-level spans run
again in their order, a receive waiting for its sender's send (plus a transfer latency), and the
replay varied one cause at a time: the ranks' start skew, the host's cost of posting messages,
and each action's variation around its kind's median. What is left over the busiest rank's
compute is the schedule's own idle time with those medians.

CPU only: the ranks' marks are `perf_counter` readings of one host, so their starts compare
across processes (a GPU's events do not).
"""

from __future__ import annotations

import functools
import re
import statistics
from collections.abc import Callable

# One rank's step: its top-level spans in order, (action name, start, end) in seconds.
Trace = list[tuple[str, float, float]]

LATENCY_S = 0.00025  # a message's transfer after its send is posted (measured on gloo, loopback)


def top_level(spans) -> Trace:
    """A step's spans without those nested in another (fills, TP waits), in time order."""
    out, end = [], float("-inf")
    for span in sorted(spans, key=lambda s: s.start):
        if span.start >= end - 1e-9:
            out.append((str(span.action), span.start, span.end))
            end = span.end
    return out


def _message(name: str) -> bool:
    return name.startswith(("SEND:", "RECV:"))


def replay(traces: list[Trace], starts: list[float], latency_s: float = LATENCY_S) -> float:
    """When the last rank ends if each runs its trace's actions back to back from `starts`,
    a RECV waiting for its SEND's end plus `latency_s` (a receive takes no time of its own)."""
    t, at, sent = list(starts), [0] * len(traces), {}
    progressed = True
    while progressed:
        progressed = False
        for r, trace in enumerate(traces):
            while at[r] < len(trace):
                name, begin, end = trace[at[r]]
                if name.startswith("RECV:"):
                    if name[5:] not in sent:
                        break  # its sender has not got there yet
                    t[r] = max(t[r], sent[name[5:]] + latency_s)
                else:
                    t[r] += end - begin
                    if name.startswith("SEND:"):
                        sent[name[5:]] = t[r]
                at[r] += 1
                progressed = True
    if any(a < len(trace) for a, trace in zip(at, traces, strict=True)):
        raise ValueError("the traces wait for messages none of them sends")
    return max(t)


def kind_of(name: str, step_microbatches: int) -> str:
    """An action's kind for medians: its name without the micro-batch, look-ahead ones apart
    (forward-only, no graph)."""
    m = re.search(r"m(\d+)", name)
    pool = m is not None and int(m.group(1)) >= step_microbatches
    return re.sub(r"m\d+", "", name) + (" (look-ahead)" if pool else "")


def decomposition(steps: list[list[tuple[float, Trace]]], step_microbatches: int) -> dict:
    """Medians over `steps` (each: per rank, the program's start on the host clock and its
    trace) of the program's measured length and of replays with one cause removed at a time:
    {measured_s, replay_s, no_skew_s, no_message_host_s, median_durations_s, compute_s}."""
    kind = functools.partial(kind_of, step_microbatches=step_microbatches)
    durations: dict[str, list[float]] = {}
    for ranks in steps:
        for _, trace in ranks:
            for name, begin, end in trace:
                if not _message(name):
                    durations.setdefault(kind(name), []).append(end - begin)
    medians = {k: statistics.median(v) for k, v in durations.items()}
    rows: dict[str, list[float]] = {}
    for ranks in steps:
        for key, value in _one_step(ranks, medians, kind).items():
            rows.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in rows.items()}


def _one_step(ranks: list[tuple[float, Trace]], medians: dict, kind: Callable) -> dict:
    first = min(start for start, _ in ranks)
    skew = [start - first for start, _ in ranks]
    traces = [trace for _, trace in ranks]
    quiet = [[(n, 0.0, 0.0) if _message(n) else (n, b, e) for n, b, e in tr] for tr in traces]
    typical = [[(n, 0.0, 0.0 if _message(n) else medians[kind(n)]) for n, _, _ in tr]
               for tr in traces]  # fmt: skip
    return {
        "measured_s": max(s + e for s, tr in zip(skew, traces, strict=True) for _, _, e in tr),
        "replay_s": replay(traces, skew),
        "no_skew_s": replay(traces, [0.0] * len(traces)),
        "no_message_host_s": replay(quiet, [0.0] * len(traces)),
        "median_durations_s": replay(typical, [0.0] * len(traces)),
        "compute_s": max(sum(e - b for n, b, e in tr if not _message(n)) for tr in traces),
    }

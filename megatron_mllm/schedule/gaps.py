"""Free compute time on each (rank, slot) around a fixed backbone timeline, and packing into it.

A gap is a stretch of idle compute stream with an anchor that says where work placed in it goes
in the rank's action list: ("after", j) between backbone compute actions j and j+1 (j = -1 is
before the first, the last one runs to infinity), or ("tp", j, n) inside TP bubble n of
backbone action j. Packing is done at kernel granularity: a kernel goes whole into one gap.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from megatron_mllm.schedule.cost_model import Kernel

Anchor = tuple


@dataclass
class Gap:
    start: float
    end: float
    anchor: Anchor
    cover_s: float = 0.0  # TP gaps: backbone compute right after, which can hide a collective

    @property
    def is_tp(self) -> bool:
        return self.anchor[0] == "tp"


@dataclass(frozen=True)
class Placed:
    """One kernel placed in a gap."""

    gap: Gap
    kernel: int
    start: float
    end: float


class GapPool:
    """Per (rank, slot) sorted gaps; ALAP and ASAP packing of kernel sequences."""

    def __init__(self) -> None:
        self.gaps: dict[tuple[int, int], list[Gap]] = {}

    def add(self, rank: int, slot: int, gap: Gap) -> None:
        if gap.end - gap.start > 1e-12:
            self.gaps.setdefault((rank, slot), []).append(gap)

    def finish(self) -> None:
        for gaps in self.gaps.values():
            gaps.sort(key=lambda g: g.start)

    def place_alap(
        self, rank: int, slot: int, kernels: list[Kernel], deadline: float, first_in_tp: bool = True
    ) -> list[Placed]:
        """Kernels as late as possible, the last one's output (after its comm) by `deadline`."""
        gaps = self.gaps[(rank, slot)]
        i = bisect.bisect_left(gaps, deadline, key=_start) - 1
        t, out = deadline, []
        for idx in range(len(kernels) - 1, -1, -1):
            k = kernels[idx]
            limit = t - k.comm_s
            while True:
                g = gaps[i]
                # A kernel's TP collective waits for the backbone's to finish (it must not
                # share the bubble's link), so in a TP gap it only counts from the gap's end.
                usable = not g.is_tp or (
                    (idx > 0 or first_in_tp)
                    and (k.comm_s == 0 or (g.end <= limit and k.comm_s <= g.cover_s))
                )
                # Between backbone actions a collective must end before the next one starts.
                end = min(g.end - (0.0 if g.is_tp else k.comm_s), limit)
                if usable and end - g.start >= k.compute_s - 1e-12:
                    break
                i -= 1
            out.append(Placed(g, idx, end - k.compute_s, end))
            t = end - k.compute_s
        out.reverse()
        return out

    def place_asap(
        self, rank: int, slot: int, kernels: list[Kernel], earliest: float, first_in_tp: bool = True
    ) -> list[Placed]:
        """Kernels as early as possible, the first one starting no earlier than `earliest`."""
        gaps = self.gaps[(rank, slot)]
        i = bisect.bisect_right(gaps, earliest, key=_end)
        t, out = earliest, []
        for idx, k in enumerate(kernels):
            while True:
                g = gaps[i]
                usable = not g.is_tp or ((idx > 0 or first_in_tp) and k.comm_s <= g.cover_s)
                begin = max(g.start, t)
                room = g.end - begin - (0.0 if g.is_tp else k.comm_s)
                if usable and room >= k.compute_s - 1e-12:
                    break
                i += 1
            out.append(Placed(g, idx, begin, begin + k.compute_s))
            done = begin + k.compute_s
            if g.is_tp and k.comm_s > 0:
                done = max(done, g.end)
            t = done + k.comm_s
        return out

    def commit(self, rank: int, slot: int, placed: list[Placed]) -> None:
        """Remove the time `placed` occupies from its gaps."""
        gaps = self.gaps[(rank, slot)]
        by_gap: dict[int, list[Placed]] = {}
        for p in placed:
            by_gap.setdefault(id(p.gap), []).append(p)
        for items in by_gap.values():
            g = items[0].gap
            pieces, t = [], g.start
            for p in sorted(items, key=lambda p: p.start):
                if p.start - t > 1e-12:
                    pieces.append(Gap(t, p.start, g.anchor, g.cover_s))
                t = p.end
            if g.end - t > 1e-12:
                pieces.append(Gap(t, g.end, g.anchor, g.cover_s))
            pos = bisect.bisect_left(gaps, g.start, key=_start)
            while gaps[pos] is not g:
                pos += 1
            gaps[pos : pos + 1] = pieces


def _start(g: Gap) -> float:
    return g.start


def _end(g: Gap) -> float:
    return g.end

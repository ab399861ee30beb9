"""Small helpers on sorted lists of disjoint [start, end) intervals."""

from __future__ import annotations

Intervals = list[tuple[float, float]]


def merge(intervals: Intervals) -> Intervals:
    """Sort and merge overlapping or touching intervals."""
    out: Intervals = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def complement(intervals: Intervals, lo: float, hi: float) -> Intervals:
    """[lo, hi) minus merged `intervals`."""
    out, t = [], lo
    for a, b in intervals:
        if a > t:
            out.append((t, min(a, hi)))
        t = max(t, b)
        if t >= hi:
            break
    if t < hi:
        out.append((t, hi))
    return [(a, b) for a, b in out if b > a]


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two merged lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """a minus b, both merged."""
    if not a:
        return []
    lo, hi = a[0][0], a[-1][1]
    return intersect(a, complement(b, lo, hi))


def total(intervals: Intervals) -> float:
    return sum(b - a for a, b in intervals)

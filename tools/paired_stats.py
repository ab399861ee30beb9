"""Paired comparisons for the benchmarks: methods run on the same seeds, so each seed gives one
difference, and the 95% interval of the mean difference is Student's t on those differences."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PairedInterval:
    """Mean of the per-seed differences (a - b) and its 95% interval [low, high]."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half(self) -> float:
        return (self.high - self.low) / 2

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def text(self, digits: int = 4) -> str:
        return f"{self.mean:+.{digits}f}+-{self.half:.{digits}f}"


def t_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def paired_interval(a: Sequence[float], b: Sequence[float]) -> PairedInterval:
    """The 95% interval of mean(a - b) over pairs (a[i], b[i]); NaN bounds for one pair."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples need equal, non-zero lengths ({len(a)} and {len(b)})")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return PairedInterval(mean, math.nan, math.nan, 1)
    half = t_975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return PairedInterval(mean, mean - half, mean + half, len(diffs))

"""Small statistics helpers: percentiles, medians with spread, formatting."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Spread:
    """The median of per-repetition values and their range."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        xs = [v for v in values if not math.isnan(v)]
        if not xs:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        if self.n == 0:
            return "n/a"
        if self.n == 1:
            return f"{self.median:.{digits}f}{unit}"
        return f"{self.median:.{digits}f}{unit} ({self.lo:.{digits}f}–{self.hi:.{digits}f})"


def ms(seconds: float) -> float:
    return seconds * 1000.0


def fmt_bytes(b: float) -> str:
    if math.isnan(b):
        return "n/a"
    if b >= 10 * 1024 * 1024:
        return f"{b / 1024 / 1024:.0f} MiB"
    if b >= 1024 * 1024:
        return f"{b / 1024 / 1024:.1f} MiB"
    if b >= 10 * 1024:
        return f"{b / 1024:.0f} KiB"
    if b >= 1024:
        return f"{b / 1024:.1f} KiB"
    return f"{b:.0f} B"

"""Paired A/B statistics for load experiments: block order, paired ratios, bootstrap intervals.

Two policies measured one after the other on a shared machine see different machines:
other processes come and go, and a service drifts over minutes. A *paired* comparison
measures them in short blocks, interleaved A B B A A B B A ..., and compares each A block
with the B block beside it: drift that is slow against two blocks cancels in the pair's
ratio A / B, and the ABBA order keeps a steady trend from favouring whichever side goes
second. Over the pairs we report the median ratio and a percentile bootstrap interval of
that median (Efron & Tibshirani 1993, ch. 13): resample the pairs with replacement, take
each resample's median. With few pairs the interval is coarse but honest; an A/A
comparison (one policy on both sides) must give an interval containing 1.

Over several load levels, per-level ratios are summarised by their geometric mean, with a
stratified bootstrap (pairs resampled within each level).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

A, B = "A", "B"


@dataclass(frozen=True)
class Interval:
    """A point estimate and its bootstrap interval ``[lo, hi]`` at ``level``."""

    point: float
    lo: float
    hi: float
    level: float = 0.95

    def __post_init__(self) -> None:
        assert self.lo <= self.point <= self.hi or not np.isfinite(self.point), self

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def verdict(self, a: str = "A", b: str = "B") -> str:
        """What the interval says about the ratio a / b."""
        if self.lo > 1.0:
            return f"{a} faster"
        if self.hi < 1.0:
            return f"{a} slower"
        return "no difference resolved"


def abba_sides(pairs: int) -> list[str]:
    """The side of each of ``2 * pairs`` blocks: A B, B A, A B, B A, ... (pair i is blocks
    2i and 2i + 1; odd pairs start with B)."""
    assert pairs >= 1
    return [s for i in range(pairs) for s in ((A, B) if i % 2 == 0 else (B, A))]


def paired_ratios(sides: Sequence[str], goodputs: Sequence[float]) -> np.ndarray:
    """``A / B`` per pair of consecutive blocks (``sides`` as from ``abba_sides``)."""
    assert len(sides) == len(goodputs) and len(sides) % 2 == 0, (len(sides), len(goodputs))
    out = []
    for i in range(0, len(sides), 2):
        pair = dict(zip(sides[i:i + 2], goodputs[i:i + 2], strict=True))
        assert set(pair) == {A, B}, sides[i:i + 2]
        out.append(pair[A] / pair[B])
    return np.asarray(out, dtype=np.float64)   # [pairs]


def bootstrap_median(ratios: Sequence[float], rng: np.random.Generator, draws: int = 10_000,
                     level: float = 0.95) -> Interval:
    """The median of ``ratios`` and a percentile bootstrap interval of it."""
    r = np.asarray(ratios, dtype=np.float64)   # [n]
    assert r.ndim == 1 and len(r) >= 1 and np.all(r > 0), r
    idx = rng.integers(0, len(r), size=(draws, len(r)))     # [draws, n]
    meds = np.median(r[idx], axis=1)                        # [draws]
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(meds, [tail, 100 - tail])
    point = float(np.median(r))
    return Interval(point, min(float(lo), point), max(float(hi), point), level)


def geomean(xs: Sequence[float]) -> float:
    x = np.asarray(xs, dtype=np.float64)
    assert len(x) and np.all(x > 0), x
    return float(np.exp(np.mean(np.log(x))))


def bootstrap_geomean_of_medians(ratios_by_level: Sequence[Sequence[float]], rng: np.random.Generator,
                                 draws: int = 10_000, level: float = 0.95) -> Interval:
    """The geometric mean over levels of each level's median ratio, and a stratified
    percentile bootstrap interval (each level's pairs resampled on their own)."""
    levels = [np.asarray(r, dtype=np.float64) for r in ratios_by_level]
    assert levels and all(len(r) and np.all(r > 0) for r in levels)
    logs = np.zeros(draws)                                  # [draws]
    for r in levels:
        idx = rng.integers(0, len(r), size=(draws, len(r)))
        logs += np.log(np.median(r[idx], axis=1))
    gm = np.exp(logs / len(levels))                         # [draws]
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(gm, [tail, 100 - tail])
    point = geomean([float(np.median(r)) for r in levels])
    return Interval(point, min(float(lo), point), max(float(hi), point), level)

"""What the controller learns online from the replicas' heartbeats (pure, no Ray).

* the calibration map ``P(accepted) = sigmoid(a * logit q + b + o)``: a logistic fit of
  (a, b) on (logit q, accepted, o) records, o being the replica's fixed offset for the
  edge's sibling rank (``fit_calibration``), shrunk toward the replicas' stored fit
  while records are few (``shrink_calibration``), judged by its expected calibration
  error (``calibration_ece``);
* what a tree of n nodes buys under the current traffic: a sliding window of
  (node cap, accepted) round records (``RoundWindow``);
* the drafting seconds per draft node, from heartbeat step-time means
  (``fit_draft_cost``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

from treespark.costmodel import AcceptanceStats

Record = tuple[float, bool, float]  # (x = logit q, accepted, o = the sibling-rank offset)


def fit_calibration(records: Sequence[Record], iters: int = 25, l2: float = 1e-3) -> tuple[float, float]:
    """Logistic regression ``P(accepted) = sigmoid(a * x + b + o)`` by damped Newton on
    (x, accepted, o) records (o fixed), a small ridge keeping it finite on separable data.
    Each step is halved until the mean loss drops: a full step from the identity start
    overshoots when acceptance depends weakly on q (the default pair at T = 1)."""
    n = len(records)
    if n == 0:
        raise ValueError("no calibration records")

    def loss(a: float, b: float) -> float:
        total = 0.0
        for x, y, o in records:
            z = a * x + b + o
            total += (max(z, 0.0) + math.log1p(math.exp(-abs(z)))) - (z if y else 0.0)
        return total / n + 0.5 * l2 * (a * a + b * b)

    a, b = 1.0, 0.0
    current = loss(a, b)
    for _ in range(iters):
        ga = gb = haa = hab = hbb = 0.0
        for x, y, o in records:
            p = _sigmoid(a * x + b + o)
            r = p - (1.0 if y else 0.0)
            w = p * (1.0 - p)
            ga += r * x
            gb += r
            haa += w * x * x
            hab += w * x
            hbb += w
        ga, gb = ga / n + l2 * a, gb / n + l2 * b
        haa, hab, hbb = haa / n + l2, hab / n, hbb / n + l2
        det = haa * hbb - hab * hab
        if det <= 1e-12:
            break
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        t = 1.0
        while (trial := loss(a - t * da, b - t * db)) > current and t > 1e-6:
            t /= 2
        if trial > current:  # no descent left at this precision
            break
        a, b, current = a - t * da, b - t * db, trial
        if t * (abs(da) + abs(db)) < 1e-8:
            break
    return a, b


def _sigmoid(z: float) -> float:
    z = max(min(z, 35.0), -35.0)
    return 1.0 / (1.0 + math.exp(-z))


def calibration_ece(records: Sequence[Record], a: float, b: float, bins: int = 15) -> float:
    """Expected calibration error of ``sigmoid(a * x + b + o)`` on (x, accepted, o)
    records, equal-width bins (as ``treespark.calibration.expected_calibration_error``)."""
    if not records:
        return float("nan")
    n_b, p_b, y_b = [0] * bins, [0.0] * bins, [0.0] * bins
    for x, y, o in records:
        p = _sigmoid(a * x + b + o)
        i = min(int(p * bins), bins - 1)
        n_b[i] += 1
        p_b[i] += p
        y_b[i] += 1.0 if y else 0.0
    return sum(abs(y_b[i] - p_b[i]) for i in range(bins) if n_b[i]) / len(records)


def shrink_calibration(fit: tuple[float, float], base: tuple[float, float], n: int,
                       prior_records: int) -> tuple[float, float]:
    """The online fit pulled toward the stored one: weight n / (n + prior_records)."""
    w = n / (n + prior_records) if prior_records > 0 else 1.0
    return (w * fit[0] + (1 - w) * base[0], w * fit[1] + (1 - w) * base[1])


class RoundWindow:
    """The last ``maxlen`` (node cap, accepted) round records, with running per-size
    sums so ``stats()`` costs O(sizes), not O(records)."""

    def __init__(self, maxlen: int = 20000, max_nodes: int = 64) -> None:
        self.maxlen, self.max_nodes = maxlen, max_nodes
        self._q: deque = deque()
        self._counts = [0] * (max_nodes + 1)
        self._sums = [0] * (max_nodes + 1)

    def extend(self, rounds: Iterable[tuple[int, int]]) -> None:
        for n, acc in rounds:
            n = min(max(int(n), 0), self.max_nodes)
            self._q.append((n, acc))
            self._counts[n] += 1
            self._sums[n] += acc
            if len(self._q) > self.maxlen:
                m, a = self._q.popleft()
                self._counts[m] -= 1
                self._sums[m] -= a

    def __len__(self) -> int:
        return len(self._q)

    def stats(self) -> AcceptanceStats | None:
        if not self._q:
            return None
        return AcceptanceStats(tuple(self._counts), tuple(float(x) for x in self._sums))


def fit_draft_cost(points: Sequence[tuple[float, float, float]], min_points: int = 20) -> float | None:
    """Drafting seconds per draft node from heartbeat means (rows, nodes per step, draft
    seconds per step): least squares of ``draft_s = c0 + c1 * rows + c2 * nodes``; None
    while the points are too few or do not vary in nodes."""
    if len(points) < min_points:
        return None
    n = len(points)
    m = [[0.0] * 3 for _ in range(3)]
    v = [0.0] * 3
    for rows, nodes, y in points:
        x = (1.0, rows, nodes)
        for i in range(3):
            v[i] += x[i] * y
            for j in range(3):
                m[i][j] += x[i] * x[j]
    mean_nodes = m[0][2] / n
    if m[2][2] / n - mean_nodes**2 < 1.0:  # nodes barely vary: c2 is not identified
        return None
    for i in range(3):
        m[i][i] += 1e-9 * n
    # Gaussian elimination on the 3x3 normal equations
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(a[r][c]))
        a[c], a[p] = a[p], a[c]
        if abs(a[c][c]) < 1e-15:
            return None
        for r in range(3):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c], strict=True)]
    return max(a[2][3] / a[2][2], 0.0)

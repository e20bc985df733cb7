"""What the controller learns online from the replicas' heartbeats (pure, no torch, no Ray).

* the calibration map ``P(accepted) = sigmoid(a * logit q + b + o)``: (a, b) refitted on
  (logit q, accepted, o) records, o being the replica's fixed offset for the edge's
  sibling rank (``fit_ab``: the library's ``fit_logistic`` with o as a fixed offset),
  shrunk toward the replicas' stored fit while records are few
  (``shrink_calibration``), judged by the library's expected calibration error
  (``ece_on_records``);
* what a tree of n nodes buys under the current traffic: a sliding window of
  (node cap, accepted) round records (``RoundWindow``);
* the drafting seconds per draft node, from heartbeat step-time means
  (``fit_draft_cost``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from treespark.pricing.costmodel import AcceptanceStats
from treespark.spec.calibration import expected_calibration_error, fit_logistic, sigmoid

Record = tuple[float, bool, float]  # (x = logit q, accepted, o = the sibling-rank offset)


def _columns(records: Sequence[Record]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N] x, [N] accepted (0/1), [N] o."""
    r = np.asarray(records, dtype=np.float64).reshape(-1, 3)
    return r[:, 0], r[:, 1], r[:, 2]


def fit_ab(records: Sequence[Record], iters: int = 25, l2: float = 1e-3) -> tuple[float, float]:
    """(a, b) of ``P(accepted) = sigmoid(a * x + b + o)`` on (x, accepted, o) records,
    o fixed; a small ridge keeps it finite on separable data."""
    if len(records) == 0:
        raise ValueError("no calibration records")
    x, y, o = _columns(records)
    w = fit_logistic(np.stack([x, np.ones_like(x)], axis=1), y, o, iters=iters, l2=l2)
    return float(w[0]), float(w[1])


def ece_on_records(records: Sequence[Record], a: float, b: float, bins: int = 15) -> float:
    """Expected calibration error of ``sigmoid(a * x + b + o)`` on (x, accepted, o)
    records (nan without records)."""
    x, y, o = _columns(records)
    return expected_calibration_error(sigmoid(a * x + b + o), y, bins)


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
    p = np.asarray(points, dtype=np.float64)                       # [N, 3]
    if p[:, 1].var() < 1.0:  # nodes barely vary: c2 is not identified
        return None
    X = np.column_stack([np.ones(len(p)), p[:, 0], p[:, 1]])      # [N, 3]
    try:  # the normal equations, a tiny ridge against rows that never vary
        c = np.linalg.solve(X.T @ X + 1e-9 * len(p) * np.eye(3), X.T @ p[:, 2])
    except np.linalg.LinAlgError:
        return None
    return max(float(c[2]), 0.0)

"""Calibration of edge acceptance: p_hat(edge) = sigmoid(a * logit(q) + b + c_r).

The drafter's probability q of a child token is a ranking signal, not a probability
of acceptance. TreeSpark fits two scalars (a, b) by logistic regression on records
(q, accepted) of edges whose ancestors were accepted, so that the product of p_hat
along a root-to-node path estimates P(node accepted): the *path survival* that
drives expansion, stopping and the serving budget. Reported with ECE and Brier.

Optionally, one offset ``c_r`` per *sibling rank* r (the r-th child of its parent,
0-based; c_0 = 0, the last offset repeats for deeper ranks). A second child with
q = 0.3 sits beside a first child that usually holds more of the mass, and at most one
child is accepted, so it survives less often than a first child with q = 0.3. The
shipped T = 0 map is the paper's two scalars (``sibling_bias = ()``: there q ranks the
siblings and the offsets bought nothing); the shipped sampled map has offsets
(``SIBLING_OFFSETS``: where the maps in use carry them).

Acceptance means different things at T = 0 (the target's argmax equals the child) and
at T > 0 (rejection sampling accepts the drawn child with probability min(1, p/q)), so
a calibration may hold a second map, ``sampled``, fitted on records of sampled
verification and used at every T > 0 (``at``). On the default pair one map fitted to
both kinds of record under-rated sampled edges of flat q: at T = 1 and theta 0.01 the
adaptive tree grew 10.2 nodes for tau 1.492; its own map grew 11.8 for tau 1.603.

The maths is numpy, so the serving controller refits (a, b) online with the same
logistic fit (``fit_logistic``) and scores it with the same ECE without loading torch;
record arrays may be torch CPU tensors. ``Calibration.p_hat`` works on a torch tensor
through its own methods (the expansion's hot path), without importing torch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

_EPS = 1e-6


def logit(q: ArrayLike) -> np.ndarray:
    """log(q / (1 - q)) in float64, q clamped to [1e-6, 1 - 1e-6] (a float gives a 0-d array)."""
    q = np.clip(np.asarray(q, dtype=np.float64), _EPS, 1 - _EPS)
    return np.log(q) - np.log1p(-q)


def sigmoid(z: ArrayLike) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    return np.exp(-np.logaddexp(0.0, -z))


@dataclass(frozen=True)
class Calibration:
    """Maps a drafter probability (and the edge's sibling rank) to an acceptance probability."""

    a: float = 1.0
    b: float = 0.0
    sibling_bias: tuple[float, ...] = ()   # c_1, c_2, ...: logit offsets of the 2nd, 3rd, ... child
    sampled: Calibration | None = None     # the map at T > 0; None: this one at every T
    # at T > 0, drafts are drawn from q at temperature_scale x T (and verified against
    # that q, so the output keeps the target's distribution at any scale): a drafter
    # more diffuse than the target accepts more drawn from a sharper q
    temperature_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sibling_bias", tuple(float(c) for c in self.sibling_bias))
        if not all(math.isfinite(v) for v in (self.a, self.b, *self.sibling_bias)):
            raise ValueError(f"calibration (a, b, sibling_bias) must be finite, got "
                             f"({self.a}, {self.b}, {self.sibling_bias})")
        if not (math.isfinite(self.temperature_scale) and self.temperature_scale > 0):
            raise ValueError(f"temperature_scale must be finite and > 0, got {self.temperature_scale}")
        if self.sampled is not None and self.sampled.sampled is not None:
            raise ValueError("a calibration's sampled map cannot hold a sampled map of its own")

    def at(self, temperature: float) -> Calibration:
        """The map for drafting at ``temperature``: ``sampled`` at T > 0 if there is one."""
        return self.sampled if temperature > 0 and self.sampled is not None else self

    def draft_temperature(self, temperature: float) -> float:
        """The temperature a request at ``temperature`` draws its drafts at: T times the
        ``temperature_scale`` of the map in force at T (``at``); 0 at T = 0, where drafts
        are ranked, not drawn."""
        return temperature * self.at(temperature).temperature_scale if temperature > 0 else 0.0

    def offset(self, rank: int) -> float:
        """c_rank: 0 for a first child; the last offset for ranks beyond the fitted ones."""
        if rank <= 0 or not self.sibling_bias:
            return 0.0
        return self.sibling_bias[min(rank, len(self.sibling_bias)) - 1]

    def p_hat(self, q: Any, rank: int = 0) -> Any:
        """p_hat of a torch tensor of drafter probabilities (float32 out), by the tensor's
        own methods: this module imports no torch."""
        q = q.float().clamp(_EPS, 1 - _EPS)
        return (self.a * (q.log() - (-q).log1p()) + self.b + self.offset(rank)).sigmoid()

    def p_hat_scalar(self, q: float, rank: int = 0) -> float:
        q = min(max(q, _EPS), 1 - _EPS)  # plain floats: the expansion calls this per node
        z = self.a * (math.log(q) - math.log1p(-q)) + self.b + self.offset(rank)
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def with_ab(self, a: float, b: float) -> Calibration:
        """New (a, b) for this map, the same sibling offsets and sampled map (what an
        online refit of the T = 0 map pushes)."""
        return replace(self, a=a, b=b)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"a": self.a, "b": self.b, "sibling_bias": list(self.sibling_bias),
                                "temperature_scale": self.temperature_scale}
        if self.sampled is not None:
            d["sampled"] = self.sampled.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        """The map in ``data`` (other keys ignored; no ``sibling_bias``: the two-scalar map;
        no ``sampled``: this map at every temperature; no ``temperature_scale``: 1)."""
        sampled = data.get("sampled")
        return cls(a=float(data["a"]), b=float(data["b"]),
                   sibling_bias=tuple(float(c) for c in data.get("sibling_bias", ())),
                   temperature_scale=float(data.get("temperature_scale", 1.0)),
                   sampled=None if sampled is None else cls.from_dict(sampled))

    def save(self, path: str | Path, **report: object) -> None:
        Path(path).write_text(json.dumps({**self.to_dict(), **report}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_dict(json.loads(Path(path).read_text()))


# Fits published with a drafter, used until `treespark calibrate` writes one beside it.
PUBLISHED: dict[str, Calibration] = {
    # the TreeSpark paper's reference code: its fit for DSpark's Qwen3-4B block-7 drafter
    "deepseek-ai/dspark_qwen3_4b_block7": Calibration(a=0.6684, b=-0.4587),
}


def calibration_for(drafter_dir: str | Path, drafter_name: str | None = None) -> Calibration:
    """The drafter's calibration: its ``calibration.json``, else the published fit for a
    drafter of that hub name, else the identity map (p_hat = q)."""
    path = Path(drafter_dir) / "calibration.json"
    if path.is_file():
        return Calibration.load(path)
    return PUBLISHED.get(drafter_name or "", Calibration())


def load_variant(path: str | Path) -> Calibration | None:
    """The other fit ``treespark calibrate`` stores beside the one in use (key ``variant``:
    with sibling offsets if the one in use has none, and the other way round), for
    side-by-side benchmarks; None if the file has none."""
    path = Path(path)
    if not path.is_file():
        return None
    v = json.loads(path.read_text()).get("variant")
    return None if v is None else Calibration.from_dict(v)


# Where the maps in use carry sibling-rank offsets: "sampled" (the default) gives them
# to the T > 0 map only. At T > 0 sibling j is accepted only after siblings 0 .. j-1 were
# rejected, so its q says little without its rank (default pair, T = 1: log-loss 0.250
# -> 0.215 and ECE 0.019 -> 0.007 against the two-scalar fit, and the adaptive tree at
# theta 0.01 1.779 -> 1.916 tokens per forward over three seeds, docs/findings.md); at
# T = 0 a child is accepted iff it is the target's argmax, q ranks the siblings
# already, and the offsets bought nothing.
SIBLING_OFFSETS = ("none", "sampled", "all")


def offsets_in_use(sibling_offsets: str) -> tuple[bool, bool]:
    """(T = 0 map, sampled map) with offsets, for a ``SIBLING_OFFSETS`` choice."""
    if sibling_offsets not in SIBLING_OFFSETS:
        raise ValueError(f"sibling_offsets must be one of {SIBLING_OFFSETS}, got {sibling_offsets!r}")
    return sibling_offsets == "all", sibling_offsets != "none"


@dataclass(frozen=True)
class CalibrationReport:
    calibration: Calibration
    n: int
    ece_before: float      # of the identity map p_hat = q
    ece_after: float
    brier_before: float
    brier_after: float
    log_loss_before: float
    log_loss_after: float


def _design(q: ArrayLike, rank: ArrayLike | None, sibling_ranks: int) -> np.ndarray:
    """[N, P] columns: logit q, 1, then [rank == r] for r = 1 .. sibling_ranks - 1 and
    [rank >= sibling_ranks] (no rank columns when ``rank`` is None)."""
    x = logit(q).ravel()
    cols = [x, np.ones_like(x)]
    if rank is not None and sibling_ranks > 0:
        r = np.asarray(rank).ravel().astype(np.int64)
        cols += [(r == j).astype(np.float64) for j in range(1, sibling_ranks)]
        cols.append((r >= sibling_ranks).astype(np.float64))
    return np.stack(cols, axis=1)


def fit_logistic(X: np.ndarray, y: ArrayLike, offset: ArrayLike | None = None, *,
                 iters: int = 100, l2: float = 1e-4) -> np.ndarray:
    """Ridge logistic regression ``P(y) = sigmoid(X w + offset)`` by damped Newton.

    X: [N, P] design; y: [N] 0/1; offset: [N] fixed logit terms (or None). Minimises the
    mean log-loss + l2/2 |w|^2 from w = (1, 0, ..., 0) (the identity map when column 0
    is logit q). A full Newton step can overshoot from there (it did on the default
    pair's T = 1 records alone: a = 4e4), so each step is halved until the loss drops.
    """
    X = np.asarray(X, dtype=np.float64)                              # [N, P]
    y = np.asarray(y, dtype=np.float64).ravel()                      # [N]
    n, d = X.shape
    if n == 0:
        raise ValueError("cannot fit a calibration on zero records")
    o = np.zeros(n) if offset is None else np.asarray(offset, dtype=np.float64).ravel()
    if len(y) != n or len(o) != n:
        raise ValueError("the design, the outcomes (and the offsets) must have the same length")

    def objective(w: np.ndarray) -> float:
        z = X @ w + o
        return float(np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * l2 * w @ w)

    w = np.zeros(d)
    w[0] = 1.0
    loss = objective(w)
    for _ in range(iters):
        p = sigmoid(X @ w + o)
        grad = X.T @ (p - y) / n + l2 * w
        hess = (X * (p * (1 - p))[:, None]).T @ X / n + l2 * np.eye(d)
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while (new_loss := objective(w - t * step)) > loss and t > 1e-6:
            t /= 2
        if new_loss > loss:  # no descent left at this precision
            break
        w, loss = w - t * step, new_loss
        if np.abs(t * step).max() < 1e-10:
            break
    return w


def fit_calibration(
    q: ArrayLike, accepted: ArrayLike, rank: ArrayLike | None = None, *,
    sibling_ranks: int = 3, iters: int = 100, l2: float = 1e-4,
) -> Calibration:
    """Logistic regression of ``accepted`` on logit(q) (and the sibling rank): ``fit_logistic``.

    q: [N] drafter probabilities of edges whose ancestors were accepted; accepted: [N] bool;
    rank: [N] each edge's sibling rank (0 = first child), or None for the two-scalar fit.
    With ``rank``, offsets are fitted for ranks 1 .. sibling_ranks (the last one pooling
    every deeper rank); a rank never seen keeps offset 0 (the ridge holds it there).
    """
    q, accepted = np.asarray(q).ravel(), np.asarray(accepted).ravel()
    if q.size != accepted.size or (rank is not None and np.asarray(rank).size != q.size):
        raise ValueError("q, accepted (and rank) must have the same length")
    w = fit_logistic(_design(q, rank, sibling_ranks), accepted, iters=iters, l2=l2)
    return Calibration(a=float(w[0]), b=float(w[1]), sibling_bias=tuple(float(c) for c in w[2:]))


def p_hat_of(cal: Calibration, q: ArrayLike, rank: ArrayLike | None = None) -> np.ndarray:
    """[N] p_hat of every record (float64), each at its own sibling rank (rank 0 if None)."""
    z = cal.a * logit(q).ravel() + cal.b
    if rank is not None and cal.sibling_bias:
        last = len(cal.sibling_bias)  # Calibration.offset is constant from this rank on
        offsets = np.array([cal.offset(r) for r in range(last + 1)])
        z = z + offsets[np.clip(np.asarray(rank).ravel().astype(np.int64), 0, last)]
    return sigmoid(z)


def expected_calibration_error(p: ArrayLike, y: ArrayLike, bins: int = 15) -> float:
    """ECE with equal-width bins: sum_b |B_b|/N * |mean(y) - mean(p)| over bin b (nan if empty)."""
    p = np.asarray(p, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if p.size == 0:
        return float("nan")
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    gap = np.bincount(idx, weights=y - p, minlength=bins)
    return float(np.abs(gap[count > 0]).sum() / p.size)


def brier_score(p: ArrayLike, y: ArrayLike) -> float:
    return float(np.mean((np.asarray(p, dtype=np.float64) - np.asarray(y, dtype=np.float64)) ** 2))


def log_loss(p: ArrayLike, y: ArrayLike) -> float:
    p = np.clip(np.asarray(p, dtype=np.float64).ravel(), 1e-12, 1 - 1e-12)
    y = np.asarray(y, dtype=np.float64).ravel()
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def calibrate(q: ArrayLike, accepted: ArrayLike, rank: ArrayLike | None = None) -> CalibrationReport:
    """Fit the calibration (with sibling offsets when ``rank`` is given) and report ECE,
    Brier and log-loss before (p_hat = q) and after."""
    q = np.asarray(q, dtype=np.float64).ravel()
    accepted = np.asarray(accepted).ravel()
    cal = fit_calibration(q, accepted, rank)
    after = p_hat_of(cal, q, rank)
    return CalibrationReport(
        calibration=cal,
        n=int(q.size),
        ece_before=expected_calibration_error(q, accepted),
        ece_after=expected_calibration_error(after, accepted),
        brier_before=brier_score(q, accepted),
        brier_after=brier_score(after, accepted),
        log_loss_before=log_loss(q, accepted),
        log_loss_after=log_loss(after, accepted),
    )

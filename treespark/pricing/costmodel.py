"""The verify-forward cost model T(bs, k) and the price of one draft node under load.

TreeSpark prices a verified draft node by ``theta`` (``treespark.spec.budget``). This module
derives that price from two measured things:

* ``CostModel``  the target forward time ``T(bs, k)`` for ``bs`` rows of ``k`` tokens
                 each (the root plus ``k - 1`` draft nodes, padded as the engine pads),
                 measured on the deployment hardware by ``treespark cost-model``
                 (``treespark.engine.cost_measure``) and stored as JSON;
* ``AcceptanceProfile``  ``A(n)``: expected draft tokens accepted per round by a
                 best-first tree of ``n`` nodes (a prior, refined online from what the
                 replicas report).

Marginal rule (TreeSpark): one step verifies ``K`` tokens and its rows expect to emit
``G`` tokens; adding a node of path survival ``s`` raises goodput ``G / T(K)`` iff

    s > G * dT/dK / T(K).

With every row holding an ``n``-node tree, ``G = bs * (1 + A(n))``, ``K = bs * (n + 1)``
and ``dT/dK = (dT/dk) / bs``, so the price is ``theta = (1 + A(n)) * T'(bs, n+1) / T(bs, n+1)``.
Drafting is not free either: best-first expansion costs about ``node_s`` seconds per
node (learned online by the controller from the replicas' draft times), added to the
step. CPU forwards are not convex in ``k`` (the measured ``T(bs, k)`` is flat for a few
tokens, then rises, with kinks where the matrix-product kernels change), so the
marginal rule alone would refuse a tree whose first node is dear and the rest nearly
free. ``plan_budget`` therefore first picks the tree size
``n*`` of highest expected goodput ``(1 + A(n)) / T(bs, n + 1)`` (``n* = 0``: plain
decoding), then prices the marginal node at ``n*``; best-first expansion under that
``theta`` and ``node_cap = n*`` stops where the calibrated survival says a node no
longer pays. When requests wait for a batch row, every second of speculative compute
also delays them (throughput mode): ``queue_weight`` scales the cost of the draft
nodes by ``1 + w * waiting / batch``.

Pure Python (no torch): the controller prices with it in a process that runs no model.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from treespark.spec.budget import DEFAULT_BRANCH_CAP

# -- the cost model ----------------------------------------------------------------------


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation; linear extrapolation beyond the ends."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostModel:
    """Target-forward seconds ``seconds[i][j]`` for ``batch_sizes[i]`` rows of
    ``tokens[j]`` tokens each, over a KV context of ``context`` tokens per row."""

    batch_sizes: tuple[int, ...]
    tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    context: int = 256
    pair: str = ""
    device: str = "cpu"
    threads: int = 0
    created: str = ""

    def __post_init__(self) -> None:
        bs, ks = tuple(int(b) for b in self.batch_sizes), tuple(int(k) for k in self.tokens)
        object.__setattr__(self, "batch_sizes", bs)
        object.__setattr__(self, "tokens", ks)
        object.__setattr__(self, "seconds", tuple(tuple(float(t) for t in row) for row in self.seconds))
        if not bs or not ks:
            raise ValueError("CostModel needs at least one batch size and one token count")
        if list(bs) != sorted(set(bs)) or bs[0] < 1:
            raise ValueError(f"CostModel.batch_sizes must be increasing and >= 1, got {bs}")
        if list(ks) != sorted(set(ks)) or ks[0] != 1:
            raise ValueError(f"CostModel.tokens must be increasing and start at 1, got {ks}")
        if len(self.seconds) != len(bs) or any(len(r) != len(ks) for r in self.seconds):
            raise ValueError("CostModel.seconds must be a [len(batch_sizes)][len(tokens)] table")
        if any(not (t > 0 and math.isfinite(t)) for r in self.seconds for t in r):
            raise ValueError("CostModel.seconds must be positive and finite")

    def time(self, bs: float, k: float) -> float:
        """T(bs, k) in seconds: bilinear in the grid; beyond the largest batch, linear in
        bs through the origin (compute-bound); beyond the largest k, the last slope."""
        bs, k = max(float(bs), 1.0), max(float(k), 1.0)
        per_bs = [interp(self.tokens, row, k) for row in self.seconds]
        top = self.batch_sizes[-1]
        if bs > top:
            return per_bs[-1] * bs / top
        return max(interp(self.batch_sizes, per_bs, bs), 1e-9)

    def slope(self, bs: float, k: float, h: float = 1.0) -> float:
        """dT/dk at (bs, k): the secant from k to k + h tokens per row (>= 0)."""
        return max(self.time(bs, k + h) - self.time(bs, k), 0.0) / h

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["batch_sizes"], d["tokens"] = list(self.batch_sizes), list(self.tokens)
        d["seconds"] = [list(r) for r in self.seconds]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CostModel:
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in keys})

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_json(json.loads(Path(path).read_text()))

    @classmethod
    def affine(cls, base_s: float, per_token_s: float, *, batch_sizes=(1, 2, 4, 8, 16, 32),
               tokens=(1, 2, 4, 8, 16, 32, 64)) -> CostModel:
        """A synthetic model T = base + per_token * bs * k (memory-bound floor plus
        compute that grows with every verified token): for tests and the simulator."""
        return cls(tuple(batch_sizes), tuple(tokens),
                   tuple(tuple(base_s + per_token_s * b * k for k in tokens) for b in batch_sizes),
                   pair="affine")


# -- acceptance: what a tree of n nodes buys ---------------------------------------------


@dataclass(frozen=True)
class AcceptanceProfile:
    """``accepted[n]``: expected draft tokens accepted per round by an ``n``-node tree
    (``accepted[0] = 0``, non-decreasing). Beyond the table the last value holds."""

    accepted: tuple[float, ...]

    def __post_init__(self) -> None:
        a = tuple(float(x) for x in self.accepted)
        if not a or a[0] != 0.0:
            raise ValueError("AcceptanceProfile.accepted must start with 0 (an empty tree accepts nothing)")
        if any(y < x - 1e-12 for x, y in zip(a, a[1:], strict=False)) or any(x < 0 for x in a):
            raise ValueError("AcceptanceProfile.accepted must be non-negative and non-decreasing")
        object.__setattr__(self, "accepted", a)

    def __call__(self, n: int) -> float:
        return self.accepted[min(max(int(n), 0), len(self.accepted) - 1)]

    @property
    def max_nodes(self) -> int:
        return len(self.accepted) - 1

    @classmethod
    def saturating(cls, ceiling: float = 1.3, scale: float = 5.0, max_nodes: int = 64) -> AcceptanceProfile:
        """A prior ``A(n) = ceiling * (1 - exp(-n / scale))``: a first drafter on SmolLM2
        accepted ~0.7 tokens with a 4-node chain and ~1.1 with a 16-node tree."""
        return cls(tuple(ceiling * (1.0 - math.exp(-n / scale)) for n in range(max_nodes + 1)))

    @classmethod
    def blend(cls, prior: AcceptanceProfile, stats: AcceptanceStats | None,
              prior_weight: float = 200.0) -> AcceptanceProfile:
        """Per tree size, the observed mean shrunk toward the prior by ``prior_weight``
        pseudo-rounds; then made non-decreasing (a bigger best-first tree contains the
        smaller one, so it cannot accept less). The prior itself is first rescaled by
        the observed/prior ratio over all rounds seen (shrunk by the same weight), so
        sizes never tried are not priced on a prior the traffic has contradicted."""
        if stats is None:
            return prior
        seen = sum(stats.sums[n] for n in range(1, len(stats.counts)))
        expect = sum(stats.counts[n] * prior(n) for n in range(1, len(stats.counts)))
        w = prior_weight * prior(1)
        scale = (seen + w) / (expect + w) if expect + w > 0 else 1.0
        prior = cls(tuple(scale * a for a in prior.accepted))
        out, best = [0.0], 0.0
        for n in range(1, prior.max_nodes + 1):
            c = stats.counts[n] if n < len(stats.counts) else 0
            s = stats.sums[n] if n < len(stats.sums) else 0.0
            v = (s + prior_weight * prior(n)) / (c + prior_weight)
            best = max(best, v)
            out.append(best)
        return cls(tuple(out))


@dataclass(frozen=True)
class AcceptanceStats:
    """Per tree size ``n``: rounds seen (``counts[n]``) and draft tokens they accepted
    (``sums[n]``); what the controller gathers from the replicas' per-round records.
    Replicas key each round by its row's budget node cap (``StepStats.node_caps``): the
    ``n`` a plan chooses is a cap, and a theta-priced tree under it is often smaller."""

    counts: tuple[int, ...] = ()
    sums: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.sums):
            raise ValueError("AcceptanceStats.counts and .sums must have the same length")

    @property
    def rounds(self) -> int:
        return sum(self.counts)

    def mean(self, n: int) -> float | None:
        return self.sums[n] / self.counts[n] if n < len(self.counts) and self.counts[n] else None


# -- the price ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What ``plan_budget`` decided for one replica, with its reasons."""

    batch: float            # rows the step is priced at (running + queued, capped at the batch)
    nodes: int              # n*: the tree size of highest expected goodput (0 = plain decoding)
    theta: float            # price of the marginal node at n* (>= 1 when nodes == 0)
    branch_cap: int
    goodput_gain: float     # expected goodput at n* over plain decoding (>= 1)
    queue_factor: float     # multiplier on the draft nodes' cost (1 unless requests wait for a row)


def step_time(cost: CostModel, bs: float, k: float, node_s: float = 0.0, queue_factor: float = 1.0) -> float:
    """One step with ``bs`` rows of ``k`` tokens: the verify forward T(bs, k) plus
    ``node_s`` seconds of drafting (expansion) per draft node; the speculative part
    (everything beyond plain decoding's T(bs, 1)) counts ``queue_factor`` times."""
    t1 = cost.time(bs, 1)
    extra = cost.time(bs, k) - t1 + node_s * max(bs, 1.0) * (k - 1)
    return t1 + queue_factor * extra


def expected_goodput(cost: CostModel, profile: AcceptanceProfile, bs: float, n: int,
                     queue_factor: float = 1.0, node_s: float = 0.0) -> float:
    """Tokens per second per row with ``n``-node trees: (1 + A(n)) / T_step(bs, n + 1)."""
    return (1.0 + profile(n)) / step_time(cost, bs, n + 1, node_s, queue_factor)


def marginal_price(cost: CostModel, bs: float, n: int, tokens_per_row: float,
                   queue_factor: float = 1.0, node_s: float = 0.0) -> float:
    """theta = G * dT/dK / T(K) with G = bs * tokens_per_row, K = bs * (n + 1) and
    dT/dK = (dT/dk) / bs, the step time including ``node_s`` of drafting per node."""
    k = n + 1
    t = step_time(cost, bs, k, node_s, queue_factor)
    return tokens_per_row * queue_factor * (cost.slope(bs, k) / max(bs, 1.0) + node_s) * max(bs, 1.0) / t


def branch_cap_for(theta: float, max_branch: int) -> int:
    """With calibrated sibling probabilities summing to at most 1, the j-th best child of
    a node survives at most 1/j as often as its parent: it can pay only if 1/j > theta."""
    if theta <= 0:
        return max_branch
    return max(1, min(max_branch, math.ceil(1.0 / theta) - 1))


def plan_budget(cost: CostModel, profile: AcceptanceProfile, *, active: float, queued: float = 0.0,
                max_batch: int | None = None, max_nodes: int = 32, max_branch: int = DEFAULT_BRANCH_CAP,
                queue_weight: float = 1.0, min_gain: float = 1.0, node_s: float = 0.0) -> Plan:
    """The tree size and price for a replica running ``active`` rows with ``queued``
    more waiting (both per replica). Queued requests that fit the batch (``max_batch``
    rows; None = unbounded) join it within a few steps, so they are priced as rows;
    only those beyond it wait for capacity and raise the price (throughput mode).
    ``min_gain``: speculate only if the best tree's expected goodput beats plain
    decoding by this factor. ``node_s``: drafting seconds per draft node (not in T)."""
    rows = active + queued
    cap = math.inf if max_batch is None else max_batch
    bs = max(min(rows, cap), 1.0)
    waiting = max(rows - cap, 0.0)
    qf = 1.0 + queue_weight * waiting / bs
    n_max = min(max_nodes, profile.max_nodes)
    plain = expected_goodput(cost, profile, bs, 0, qf, node_s)
    best_n, best = 0, plain
    for n in range(1, n_max + 1):
        g = expected_goodput(cost, profile, bs, n, qf, node_s)
        if g > best * (1 + 1e-9):
            best_n, best = n, g
    gain = best / plain
    if best_n == 0 or gain < min_gain:
        return Plan(bs, 0, 1.0, 1, 1.0, qf)
    theta = marginal_price(cost, bs, best_n, 1.0 + profile(best_n), qf, node_s)
    if theta >= 1.0:
        return Plan(bs, 0, theta, 1, 1.0, qf)
    return Plan(bs, best_n, theta, branch_cap_for(theta, max_branch), gain, qf)


# -- tables ----------------------------------------------------------------------------


def monotone(seconds: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """Running maxima along k, then along bs: a forward never gets cheaper with more rows
    or tokens, so timing noise must not create negative marginal costs."""
    rows = [list(r) for r in seconds]
    for r in rows:
        for j in range(1, len(r)):
            r[j] = max(r[j], r[j - 1])
    for i in range(1, len(rows)):
        rows[i] = [max(x, y) for x, y in zip(rows[i], rows[i - 1], strict=True)]
    return tuple(tuple(r) for r in rows)


def format_table(cost: CostModel) -> str:
    """A markdown table of T(bs, k) in milliseconds."""
    head = "| bs \\ k | " + " | ".join(str(k) for k in cost.tokens) + " |"
    sep = "|---|" + "---|" * len(cost.tokens)
    rows = [f"| {b} | " + " | ".join(f"{t * 1e3:.1f}" for t in row) + " |"
            for b, row in zip(cost.batch_sizes, cost.seconds, strict=True)]
    return "\n".join([head, sep, *rows])

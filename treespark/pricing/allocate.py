"""Per-step allocation: which drafted nodes one decode step verifies, across the batch.

After drafting, every running request holds a tree of candidates, each with a
*score*: the calibrated probability it is accepted, known before its own token was
drawn (``treespark.spec.select``). Scores never rise from a node to its children or along
siblings, so in the order (score descending, then node index) every prefix of a
tree's nodes is a tree. One step verifies, for each row ``r``, a prefix of ``k_r``
nodes, and pays

    step(k) = D + T(bs, max_r k_r + 1) + h * sum_r k_r

(``D``: the step's drafting and host seconds, from the replica's drafting table by rows
and each row's node cap, ``StepCosts.drafting_s``; ``T``: the verify forward of ``bs`` rows
padded to the largest tree, from the replica's cost table; ``h``: host seconds per
verified node), and expects to emit ``bs + sum of the chosen scores`` tokens. The
goodput-optimal choice takes the global top ``B`` of all rows' candidates (by score,
ties to the lower row, then the lower node index), at most ``kappa`` of them per row,
for the ``(kappa, B)`` maximising

    (bs + S) / step(k),       S = the chosen scores' sum.

**Lossless at T > 0.** Recursive rejection sampling needs each sibling to be a fresh
draw: whether slot ``j`` is verified may depend on what ranks above it, never on its
own draw, and the scores of ``j``'s descendants and later siblings depend on that draw.
So the argmax over ``B`` is exact only for T = 0 rows (any prefix-closed set verifies
exactly there). A T > 0 row enters the argmax through a *proxy* that its current draws
cannot move (its candidates' scores of the step before: history), and keeps its own
candidates scoring at least the *step's theta*: the lowest score the argmax takes, and
never below the controller's theta. That is drafting under a price theta, the rule
``treespark.spec.select`` proves lossless, with a theta fixed before this row's draws.

numpy only: the allocation is tested, and benchmarked, without a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from treespark.pricing.costmodel import CostModel


def draft_cap(pad):
    """The node cap a plan of ``pad`` (an int or an array) drafts each row under: twice
    the pad, room for the trees to grow."""
    return 2 * pad


@dataclass
class StepCosts:
    """A replica's step costs: the verify forward ``cost`` (T(bs, k)), ``node_s`` host
    seconds per verified node, and ``draft``: the seconds a step that drafts at all
    spends drafting, by its rows and each row's node cap (a ``CostModel`` over (rows, node
    cap); None: drafting is free), times ``draft_scale`` (an online correction). Drafting
    is priced by the cap, not by the nodes it yields: its waves (one per depth the tree
    can reach) set its time, and a cap of 1 is one wave where a cap of 32 is ~5 (default
    pair, one row: 3.5 vs 8.3 ms). Rows of ``T(bs, k + 1)`` for k = 0 .. ``max_nodes`` are
    cached per batch size (the allocation runs every step)."""

    cost: CostModel
    node_s: float = 0.0
    max_nodes: int = 64
    draft: CostModel | None = None
    draft_scale: float = 1.0   # online correction (``costfit.CostFit``) of ``draft``
    base_scale: float = 1.0    # online corrections (``costfit.CostFit``): T(bs, 1) x base_scale,
    extra_scale: float = 1.0   # T(bs, k + 1) - T(bs, 1) x extra_scale
    row_scale: dict[int, float] = field(default_factory=dict)   # the verify row of bs rows x row_scale[bs] (absent: 1)
    # caches per batch size (new in every copy: ``dataclasses.replace`` leaves them behind)
    _rows: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)
    _draft_rows: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)
    _by_pad: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def drafting_s(self, bs: int, cap: int) -> float:
        """Seconds of a step that drafts ``bs`` rows of at most ``cap`` nodes each (0: no drafting)."""
        return float(self.drafting_row(bs)[min(max(cap, 0), self.max_nodes)]) if bs > 0 else 0.0

    def drafting_row(self, bs: int) -> np.ndarray:
        """[max_nodes + 1] seconds: ``drafting_s(bs, cap)`` for caps 0 .. max_nodes (cached per
        batch size: the plan prices every pad's cap each time it is made)."""
        row = self._draft_rows.get(bs)
        if row is None:
            caps = range(1, self.max_nodes + 1)
            row = np.array([0.0, *(self.draft.time(bs, c) for c in caps)]) if self.draft is not None \
                else np.zeros(self.max_nodes + 1)
            row = self.draft_scale * row
            self._draft_rows[bs] = row
        return row

    def drafting_by_pad(self, bs: int) -> np.ndarray:
        """[max_nodes + 1] seconds: the drafting of a plan of each pad (at its ``draft_cap``)
        at ``bs`` rows (cached per batch size)."""
        row = self._by_pad.get(bs)
        if row is None:
            row = self._by_pad[bs] = self.drafting_row(bs)[np.minimum(draft_cap(np.arange(self.max_nodes + 1)),
                                                                      self.max_nodes)]
        return row

    def verify_row(self, bs: int) -> np.ndarray:
        """[max_nodes + 1] seconds: ``T(bs, k + 1)`` for trees of k = 0 .. max_nodes nodes."""
        row = self._rows.get(bs)
        if row is None:
            row = np.array([self.cost.time(bs, k + 1) for k in range(self.max_nodes + 1)])
            row = np.maximum.accumulate(row)  # more tokens never cost less
            row = self.row_scale.get(bs, 1.0) * (self.base_scale * row[0] + self.extra_scale * (row - row[0]))
            self._rows[bs] = row
        return row


@dataclass(frozen=True)
class Allocation:
    """What one step verifies: ``counts[r]`` draft nodes of row ``r`` (its top ones by
    score), the price theta that cut them, and the expected goodput (tokens/s) of that choice
    and of plain decoding."""

    counts: tuple[int, ...]
    theta: float              # the step's price: the lowest score taken, at least the controller's theta
                              # (inf: plain decoding is best)
    goodput: float
    plain_goodput: float

    @property
    def nodes(self) -> int:
        return sum(self.counts)

    @property
    def pad(self) -> int:
        return max(self.counts, default=0)


@dataclass(frozen=True)
class Best:
    """The argmax over (kappa, B) (``best_allocation``)."""

    rows: np.ndarray      # [N] row of each candidate, in rank order
    scores: np.ndarray    # [N]
    pad: int              # kappa: the most nodes any row takes
    take: int             # ranks 1 .. take are looked at; of those, the first kappa of each row are taken
    goodput: float
    plain: float


def best_allocation(scores: Sequence[Sequence[float]], costs: StepCosts, draft_s: float, theta: float,
                    ahead: bool = False) -> Best:
    """The argmax over (kappa, B): the top B candidates with at most kappa per row. For a
    pad kappa and a node count the cost is fixed and the top scores are best, so this is
    the optimum over all per-row counts. ``ahead``: a step not drafted yet, so drafting
    is priced too, at the cap a pad drafts under (``draft_cap``; nothing when no node is
    taken). numpy, the reference: the engine calls ``treespark.kernels.best``'s, the same
    doubles in one native call where the kernels are built."""
    bs = len(scores)
    lens = [min(len(s), costs.max_nodes) for s in scores]
    if not any(lens):
        t0 = draft_s + costs.verify_row(max(bs, 1))[0]
        return Best(np.zeros(0, dtype=np.int64), np.zeros(0), 0, 0, bs / t0, bs / t0)
    s = np.concatenate([np.asarray(x, dtype=np.float64)[:n] for x, n in zip(scores, lens, strict=True)])
    rows = np.repeat(np.arange(bs), lens)
    idx = np.concatenate([np.arange(n) for n in lens])
    ok = s >= max(theta, 1e-12)
    s, rows, idx = s[ok], rows[ok], idx[ok]
    order = np.lexsort((idx, rows, -s))
    s, rows = s[order], rows[order]
    t = costs.verify_row(bs)
    plain = bs / (draft_s + t[0])
    if len(s) == 0:
        return Best(rows, s, 0, 0, plain, plain)
    by_row = np.argsort(rows, kind="stable")                  # each row's candidates, in rank order
    idx = np.empty_like(by_row)                               # a candidate's rank within its row
    idx[by_row] = np.arange(len(rows)) - np.searchsorted(rows[by_row], rows[by_row])
    kappa = np.arange(1, int(idx.max(initial=-1)) + 2)[:, None]   # [K, 1] pads worth trying
    fixed = costs.drafting_by_pad(bs)[kappa] if ahead else 0.0   # [K, 1]
    taken = idx[None, :] < kappa                              # [K, N]
    tokens = bs + np.cumsum(np.where(taken, s[None, :], 0.0), axis=1)
    nodes = np.cumsum(taken, axis=1)
    pad = np.minimum(np.maximum.accumulate(idx + 1)[None, :], kappa)
    good = tokens / (draft_s + fixed + t[pad] + costs.node_s * nodes)  # [K, N]
    k, m = np.unravel_index(int(np.argmax(good)), good.shape)
    if good[k, m] <= plain:
        return Best(rows, s, 0, 0, plain, plain)
    return Best(rows, s, int(kappa[k, 0]), int(m) + 1, float(good[k, m]), plain)


# (scores, costs, draft_s, theta, ahead) -> the argmax (``best_allocation``, or the native one)
BestFn = Callable[[Sequence[Sequence[float]], StepCosts, float, float, bool], Best]


def allocate(scores: Sequence[Sequence[float]], costs: StepCosts, *, draft_s: float = 0.0,
             theta: float = 0.0, sampled: Sequence[bool] | None = None,
             proxies: Sequence[Sequence[float] | None] | None = None, best: BestFn | None = None) -> Allocation:
    """The nodes one step verifies (see the module docstring).

    scores[r]: row ``r``'s candidate scores in node order (node 1 first; the root is not a
    candidate), each tree's order prefix-closed under (score desc, index); draft_s: the
    step's drafting and host seconds; theta: the controller's price (no node scoring below
    it is taken); sampled[r]: the row draws at T > 0, so it is priced through ``proxies[r]``
    (None: it does not enter the argmax) and cut at the price and the pad."""
    bs = len(scores)
    sampled = [False] * bs if sampled is None else list(sampled)
    proxies = [None] * bs if proxies is None else list(proxies)
    view = [(() if p is None else p) if smp else s for s, smp, p in zip(scores, sampled, proxies, strict=True)]
    best = (best or best_allocation)(view, costs, draft_s, theta, False)
    if len(best.scores) == 0:
        step_theta, pad = theta, costs.max_nodes   # nothing to price against: the drafting budget decides
    elif best.take == 0:
        step_theta, pad = math.inf, 0              # plain decoding is best
    else:
        step_theta, pad = max(float(best.scores[:best.take].min()), theta), best.pad
    argmax = np.minimum(np.bincount(best.rows[:best.take], minlength=bs), best.pad)
    counts = []
    for i, (s, smp) in enumerate(zip(scores, sampled, strict=True)):
        if smp:
            a = np.asarray(s, dtype=np.float64)[:costs.max_nodes]
            counts.append(min(int(np.count_nonzero(a >= max(step_theta, 1e-12))), pad))
        else:
            counts.append(int(argmax[i]))
    return Allocation(tuple(counts), step_theta, step_goodput(scores, counts, costs, draft_s), best.plain)


@dataclass(frozen=True)
class DraftPlan:
    """How much the next step should draft: at most ``pad`` nodes per row (0: plain
    decoding, no drafter call), forecast from the rows' last candidates."""

    pad: int
    theta: float              # the price of the plan, as Allocation.theta
    goodput: float
    plain_goodput: float


def plan_drafting(forecasts: Sequence[Sequence[float]], costs: StepCosts, *, theta: float = 0.0,
                  best: BestFn | None = None) -> DraftPlan:
    """The best (kappa, B) over ``forecasts`` (each row's candidate scores of its last
    drafted step: history, so nothing the next step draws moves it) with the drafting
    costs counted: the pad worth drafting for the next step (``best`` as ``allocate``'s)."""
    best = (best or best_allocation)(forecasts, costs, 0.0, theta, True)
    if best.take == 0:
        return DraftPlan(0, math.inf, best.plain, best.plain)
    return DraftPlan(best.pad, max(float(best.scores[:best.take].min()), theta), best.goodput, best.plain)


def step_goodput(scores: Sequence[Sequence[float]], counts: Sequence[int], costs: StepCosts,
            draft_s: float = 0.0) -> float:
    """Expected tokens per second of a step verifying each row's top ``counts[r]`` nodes."""
    bs = len(scores)
    tokens = bs + sum(float(np.sort(np.asarray(s, dtype=np.float64))[::-1][:c].sum())
                      for s, c in zip(scores, counts, strict=True))
    t = costs.verify_row(max(bs, 1))[max(counts, default=0)]
    return tokens / (draft_s + t + costs.node_s * sum(counts))


def best_prefix(scores: Sequence[Sequence[float]], costs: StepCosts, *, draft_s: float = 0.0,
                theta: float = 0.0) -> Allocation:
    """The unconstrained argmax over B (the first best), every row's own candidates seen:
    exact at T = 0, the bound ``allocate`` is compared with for T > 0 rows."""
    return allocate(scores, costs, draft_s=draft_s, theta=theta)

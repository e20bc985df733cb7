"""Which draft nodes a round verifies: the top of a monotone score, grown in depth waves.

Terms. Opening a tree node ``n`` asks the drafter for its children: ``branch_cap``
*slots*, in order (T = 0: the top-k of q(. | n); T > 0: draws without replacement
from q). Slot ``j`` of ``n`` is a *candidate*; its *score* is

    score(n, j) = min(score(n, j - 1), score(n), survival(n) * e(n, j))

where ``e(n, j)`` is the slot's expected acceptance *before its own token is known*
(T = 0: p_hat_j(q_j) of the j-th best token; T > 0: E[p_hat_j(q(x))] over x drawn
from q without the tokens of slots 0..j-1). Taking the slot makes a node whose
*survival* is survival(n) * p_hat_j(q(x_j)), the calibrated probability that it is
accepted (TreeSpark; at T = 0 it equals the score).

Scores never rise from a node to its children or from a slot to the next sibling,
so the ``node_cap`` best candidates scoring at least ``theta`` (ties to the earlier
candidate) form a tree: that tree is the round's draft, the same one sequential
best-first expansion would stop at. It is found in *waves*: each wave opens, in one
batched drafter call, every kept node whose children could still enter the top
(``to_open``: lazily, never a node whose best child would lose), so a
round costs one drafter call per depth level, and the host sees only ``branch_cap``
(and ``TOP_M``) numbers per opened node, never a vocabulary-sized row. ``TreeBuilder``
grows one request's tree node by node (the host reference, ``treespark.spec.expand``);
``treespark.spec.forest.Forest`` grows a batch's trees as array operations (the engine's),
and builds the same trees.

Lossless at T > 0: whether slot j is verified depends on the scores of candidates
that rank above it, none of which depends on slot j's own draw (its descendants and
later siblings score no higher and lose ties), so each sibling stays a fresh draw
from its proposal, as recursive rejection sampling requires (``treespark.spec.verify``).
"""

from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass, field

import numpy as np

from treespark.spec.budget import Budget
from treespark.spec.calibration import _EPS, Calibration
from treespark.spec.tree import DraftTree

TOP_M = 16  # the largest q values of each opened node that reach the host (T > 0 expectations)


@dataclass(frozen=True)
class Slots:
    """The children a drafter offers one opened node, in verification order."""

    ids: tuple[int, ...]        # draft-vocabulary indices
    q: tuple[float, ...]        # each token's probability under the distribution it came from
    expected: tuple[float, ...]  # e(n, j): the slot's acceptance expected before its draw
    realized: tuple[float, ...]  # p_hat_j(q_j): the acceptance once the token is known


@dataclass(frozen=True)
class SlotArrays:
    """``Slots`` for P opened nodes as arrays padded to ``k``: row p's first ``count[p]``
    columns are its slots in verification order."""

    ids: np.ndarray       # [P, k] int64 draft-vocabulary indices
    q: np.ndarray         # [P, k] float64 each token's probability under its distribution
    expected: np.ndarray  # [P, k] float64 e(n, j): acceptance expected before the draw
    realized: np.ndarray  # [P, k] float64 p_hat_j(q_j): acceptance once the token is known
    count: np.ndarray     # [P] int64 slots per node

    @classmethod
    def empty(cls, p: int, k: int) -> SlotArrays:
        return cls(np.zeros((p, k), np.int64), np.zeros((p, k)), np.zeros((p, k)), np.zeros((p, k)),
                   np.zeros(p, np.int64))

    def put(self, at: np.ndarray, part: SlotArrays) -> None:
        """Write ``part``'s rows at rows ``at`` (its k may be smaller)."""
        k = part.ids.shape[1]
        self.ids[at, :k], self.q[at, :k] = part.ids, part.q
        self.expected[at, :k], self.realized[at, :k] = part.expected, part.realized
        self.count[at] = part.count


def p_hat_ranked(cal: Calibration, q: np.ndarray, rank: np.ndarray | int) -> np.ndarray:
    """``cal.p_hat_scalar`` elementwise in float64: q at sibling rank ``rank`` (broadcast)."""
    q = np.clip(q, _EPS, 1 - _EPS)
    offsets = np.array([cal.offset(r) for r in range(len(cal.sibling_bias) + 1)])
    off = offsets[np.minimum(rank, len(cal.sibling_bias))]
    z = cal.a * (np.log(q) - np.log1p(-q)) + cal.b + off
    with np.errstate(over="ignore"):
        return np.where(z > -700, 1.0 / (1.0 + np.exp(-z)), 0.0)


def slot_table(top_q: np.ndarray, top_ids: np.ndarray, drawn_ids: np.ndarray | None,
               drawn_q: np.ndarray | None, cal: Calibration, k: int, vocab: int) -> SlotArrays:
    """``slot_values`` for P opened nodes at once (to rounding: sums are taken in another
    order), as array operations over [P, k] (and [P, k, M]): top_q / top_ids [P, M];
    drawn_ids / drawn_q [P, >= k] (None at T = 0).
    Rank j's numbers depend only on slots 0..j, so a node whose budget offers fewer
    slots takes the first ones."""
    p = top_q.shape[0]
    ranks = np.arange(k)
    if drawn_ids is None:
        q = top_q[:, :k]
        n = (q > 0).sum(1)                                   # descending: the positive ones lead
        realized = p_hat_ranked(cal, q, ranks[None, :q.shape[1]])
        return SlotArrays(top_ids[:, :k].astype(np.int64), q.astype(np.float64), realized, realized, n)
    m = top_q.shape[1]
    ids, q = drawn_ids[:, :k], drawn_q[:, :k]
    tail = np.maximum(1.0 - top_q.sum(1), 0.0)                             # [P]
    tail_q = tail / max(vocab - m, 1)
    # e(n, j) before slot j's draw: the top exactly and the tail spread evenly, less slots 0..j-1
    total = ((top_q[:, None, :] * p_hat_ranked(cal, top_q[:, None, :], ranks[None, :, None])).sum(2)
             + tail[:, None] * p_hat_ranked(cal, tail_q[:, None], ranks[None]))          # [P, k]
    before = np.tril(np.ones((k, k), dtype=bool), -1)                       # [j, i]: i < j
    taken = (before[None] * (q[:, None, :] * p_hat_ranked(cal, q[:, None, :], ranks[None, :, None]))).sum(2)
    mass = np.concatenate([np.zeros((p, 1)), np.cumsum(q, 1)[:, :-1]], 1)  # drawn before slot j
    repeat = ((ids[:, :, None] == ids[:, None, :]) & before[None]).any(2)
    # beyond the support (or a rounding repeat): no more distinct tokens
    ok = np.logical_and.accumulate((q > 0) & ~repeat & (mass < 1.0 - 1e-12), axis=1)
    n = ok.sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):  # (only past a row's last slot)
        expected = np.minimum(np.maximum(total - taken, 0.0) / (1.0 - mass), 1.0)
    realized = p_hat_ranked(cal, q, ranks[None])
    return SlotArrays(ids.astype(np.int64), q.astype(np.float64), expected, realized, n)


def slot_values(top_q: list[float], top_ids: list[int], drawn: list[tuple[int, float]] | None,
                cal: Calibration, k: int, vocab: int) -> Slots:
    """The slots of one opened node from what reaches the host (``slot_table`` does the
    same for many nodes at once as array operations, to rounding).

    top_q / top_ids: the node's ``TOP_M`` largest probabilities (descending) and their
    indices; drawn: T > 0, the (index, q) of its ``k`` draws without replacement, in draw
    order (None at T = 0, where the slots are the top-k). ``cal`` is the map in force
    (``Calibration.at(T)``); e(n, j) at T > 0 sums exactly over the top and estimates
    the tail, which holds the rest of the mass spread evenly (any estimate is lossless:
    it only ranks slots before their draws)."""
    if drawn is None:
        pairs = [(i, q) for i, q in zip(top_ids[:k], top_q[:k], strict=True) if q > 0]
        realized = [cal.p_hat_scalar(q, j) for j, (_, q) in enumerate(pairs)]
        return Slots(tuple(i for i, _ in pairs), tuple(q for _, q in pairs), tuple(realized), tuple(realized))
    tail = max(1.0 - sum(top_q), 0.0)
    tail_q = tail / max(vocab - len(top_q), 1)
    ids, qs, expected, realized = [], [], [], []
    mass = 0.0
    for j, (i, q) in enumerate(drawn[:k]):
        if q <= 0 or i in ids or mass >= 1.0 - 1e-12:
            break  # beyond the support (or a rounding repeat): no more distinct tokens
        total = sum(t * cal.p_hat_scalar(t, j) for t in top_q) + tail * cal.p_hat_scalar(tail_q, j)
        taken = sum(qp * cal.p_hat_scalar(qp, j) for qp in qs)
        expected.append(min(max(total - taken, 0.0) / (1.0 - mass), 1.0))
        realized.append(cal.p_hat_scalar(q, j))
        ids.append(i)
        qs.append(q)
        mass += q
    return Slots(tuple(ids), tuple(qs), tuple(expected), tuple(realized))


@dataclass
class _Node:
    """A candidate: a slot of an opened node (the root is candidate 0)."""

    parent: int
    draft_id: int
    q: float
    score: float
    survival: float
    depth: int
    opened: bool = False


@dataclass
class TreeBuilder:
    """One request's draft for one round: candidates, the kept top, what to open next.

    ``depth_limit``: the deepest node a round may hold (the drafter's block, and the
    tokens the request may still emit)."""

    root_token: int
    budget: Budget
    depth_limit: int
    draft_to_target: list[int] | None = None  # draft index -> token id (None: identity)
    nodes: list[_Node] = field(default_factory=list)
    # the candidates scoring >= theta as (-score, index), kept in order as they are added
    _ranked: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = [_Node(parent=-1, draft_id=-1, q=1.0, score=1.0, survival=1.0, depth=0)]

    @property
    def speculates(self) -> bool:
        return not self.budget.is_off and self.depth_limit > 0

    def kept(self) -> list[int]:
        """The kept candidates, best first: the root, then the ``node_cap`` best scoring
        >= theta (ties to the earlier candidate)."""
        return [0, *(i for _, i in self._ranked[: self.budget.node_cap])]

    def to_open(self) -> list[int]:
        """Kept nodes, not yet opened, one of whose children could still be kept."""
        if not self.speculates:
            return []
        kept = self.kept()
        full = len(kept) - 1 >= self.budget.node_cap
        floor = self.nodes[kept[-1]].score if full else -math.inf
        return [i for i in kept if not self.nodes[i].opened and self.nodes[i].depth < self.depth_limit
                and self._child_bound(i) >= self.budget.theta
                and (self._child_bound(i) > floor if full else True)]

    def _child_bound(self, node: int) -> float:
        """No child of ``node`` can score above this."""
        n = self.nodes[node]
        return min(n.score, n.survival)

    def token(self, node: int) -> int:
        """The token id a candidate holds (the root's for node 0)."""
        if node == 0:
            return self.root_token
        d = self.nodes[node].draft_id
        return d if self.draft_to_target is None else self.draft_to_target[d]

    def open(self, node: int, slots: Slots) -> None:
        """Add the children ``slots`` offers under ``node`` as candidates."""
        n = self.nodes[node]
        assert not n.opened, "a node is opened once"
        n.opened = True
        prev = self._child_bound(node)
        for i, q, e, r in zip(slots.ids, slots.q, slots.expected, slots.realized, strict=True):
            score = min(prev, n.survival * e)
            self.nodes.append(_Node(parent=node, draft_id=i, q=q, score=score,
                                    survival=n.survival * r, depth=n.depth + 1))
            if score >= self.budget.theta:
                insort(self._ranked, (-score, len(self.nodes) - 1))
            prev = score

    def finish(self) -> tuple[DraftTree, list[int]]:
        """The round's tree, and for each of its nodes the candidate it came from."""
        keep = sorted(self.kept())      # creation order: parents before children, siblings in rank order
        tree = DraftTree.root_only(self.root_token)
        index = {0: 0}
        for c in keep[1:]:
            n = self.nodes[c]
            index[c] = tree.add(index[n.parent], self.token(c), q=n.q, survival=n.survival)
        return tree, keep

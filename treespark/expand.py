"""Best-first expansion of a draft tree under calibrated path survival (TreeSpark).

The frontier holds *candidate slots*: "the j-th child of node n". A slot's score is
survival(n) x e(n, j), the calibrated probability that its token will be accepted.
Expansion pops the best slot, draws its token, and stops when the best slot scores
below ``budget.theta`` or the tree holds ``budget.node_cap`` nodes. Depth is capped by
the drafter's block; siblings by ``budget.branch_cap``.

The calibration is ``calibration.at(temperature)``: its sampled map at T > 0.

* T = 0: a node's children are the top-k of q(. | parent, depth), in order;
  e(n, j) = p_hat_j(q_j), p_hat_j being the calibration at sibling rank j.
* T > 0: siblings are drawn without replacement from the temperature-scaled q. A
  slot is chosen on its *expected* acceptance before its token is drawn,
  e(n, j) = E_{x ~ q without the drawn}[p_hat_j(q(x))]: a slot kept or dropped on the
  value of its own draw would bias the output (the proof of recursive rejection
  sampling needs each sibling to be a fresh draw from its proposal).

``rank`` switches the scoring signal for benchmarks only: "calibrated" (TreeSpark),
"logq" (raw path log-probability, EAGLE-2 style) and "marginal" (per-depth marginals
that ignore the parent, the signal of earlier trees: every node at one depth gets the
same candidates, drawn from the base logits U alone).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from treespark.budget import Budget
from treespark.calibration import Calibration
from treespark.sampling import Sampler, draft_probs
from treespark.tree import DraftTree

Rank = Literal["calibrated", "logq", "marginal"]


class Proposal(Protocol):
    """What the drafter offers the expander for one request and one round."""

    max_depth: int
    draft_to_target: torch.Tensor | None  # [Vd] token id of each draft index; None = identity

    def logits(self, parent_token: int, depth: int) -> torch.Tensor:
        """Drafter logits over its vocabulary for a child at ``depth`` (1-based) of a
        node holding ``parent_token``: U_depth + W2 . W1[parent]."""
        ...

    def marginal_logits(self, depth: int) -> torch.Tensor:
        """Parent-free logits at ``depth`` (the base logits U alone)."""
        ...


@dataclass
class _Expected:
    """T > 0, under one sibling rank's calibration: each token's acceptance ``p`` and
    sum_x q(x) p(x) over every token (``total``) and over those drawn so far (``drawn``)."""

    p: torch.Tensor
    total: float
    drawn: float


@dataclass
class _Slots:
    """The children of one expanded node: their drawing distribution and what is drawn."""

    q: torch.Tensor          # [Vd] float64, the drawing distribution
    top_q: list[float]       # T = 0: the top-k probabilities, in order
    top_idx: list[int]
    mass_drawn: float = 0.0
    drawn: list[int] | None = None
    support: int = 0
    # T > 0: one entry per distinct sibling-rank offset in use (one when there are none)
    expected: dict[float | None, _Expected] = field(default_factory=dict)


def _edge_value(cal: Calibration, q: float, rank: Rank, sibling: int) -> float:
    if rank == "calibrated":
        return cal.p_hat_scalar(q, sibling)
    return q  # logq and marginal multiply raw probabilities along the path


def expand(
    proposal: Proposal,
    root_token: int,
    budget: Budget,
    calibration: Calibration,
    temperature: float,
    sampler: Sampler,
    *,
    max_depth: int | None = None,
    rank: Rank = "calibrated",
) -> DraftTree:
    """Grow one draft tree best-first under ``budget``; see the module docstring."""
    calibration = calibration.at(temperature)
    tree = DraftTree.root_only(root_token)
    tree.draft_to_target = proposal.draft_to_target
    depth_limit = proposal.max_depth if max_depth is None else min(proposal.max_depth, max_depth)
    if budget.is_off or depth_limit <= 0:
        return tree
    greedy = temperature == 0
    k = budget.branch_cap
    slots: dict[int, _Slots] = {}
    heap: list[tuple[float, int, int, int]] = []
    tie = itertools.count()

    def open_node(n: int) -> None:
        depth = tree.depths[n] + 1
        if depth > depth_limit:
            return
        if rank == "marginal":  # earlier trees: the same candidates under every parent
            logits = proposal.marginal_logits(depth)
        else:
            logits = proposal.logits(tree.tokens[n], depth)
        q = draft_probs(logits, temperature).to(torch.float64)
        st = _Slots(q=q, top_q=[], top_idx=[], support=int((q > 0).sum()))
        if greedy:
            top = q.topk(min(k, q.numel()))
            st.top_idx = top.indices.tolist()
            st.top_q = top.values.tolist()
        else:
            st.drawn = []
        slots[n] = st
        push(n, 0)

    def expected(st: _Slots, j: int) -> _Expected:
        """What slot j draws from: sibling rank j's calibration (raw q for the
        benchmark rankings), computed once per distinct offset."""
        key = calibration.offset(j) if rank == "calibrated" else None
        e = st.expected.get(key)
        if e is None:
            p = calibration.p_hat(st.q, j).to(torch.float64) if rank == "calibrated" else st.q
            e = _Expected(p, float((st.q * p).sum()), float((st.q[st.drawn] * p[st.drawn]).sum()))
            st.expected[key] = e
        return e

    def slot_score(n: int, j: int) -> float | None:
        st = slots[n]
        if j >= k:
            return None
        if greedy:
            if j >= len(st.top_q):
                return None
            e = _edge_value(calibration, st.top_q[j], rank, j)
        else:
            remaining = 1.0 - st.mass_drawn
            if j >= st.support or remaining <= 1e-12:
                return None
            x = expected(st, j)  # over what is left to draw
            e = max(x.total - x.drawn, 0.0) / remaining
        return tree.survival[n] * e

    def push(n: int, j: int) -> None:
        s = slot_score(n, j)
        if s is not None:
            heapq.heappush(heap, (-s, next(tie), n, j))

    open_node(0)
    while heap and tree.size < budget.node_cap:
        neg_score, _, n, j = heapq.heappop(heap)
        if -neg_score < budget.theta:
            break
        st = slots[n]
        if greedy:
            d = st.top_idx[j]
            survival = -neg_score
        else:
            remaining = st.q.clone()
            assert st.drawn is not None
            if st.drawn:
                remaining[st.drawn] = 0.0
            remaining = remaining / remaining.sum()
            d = sampler.categorical(remaining)
            st.drawn.append(d)
            st.mass_drawn += float(st.q[d])
            for x in st.expected.values():
                x.drawn += float(st.q[d] * x.p[d])
            survival = tree.survival[n] * _edge_value(calibration, float(st.q[d]), rank, j)
        token = d if proposal.draft_to_target is None else int(proposal.draft_to_target[d])
        i = tree.add(n, token, q=float(st.q[d]), survival=survival)
        push(n, j + 1)
        open_node(i)
    tree.child_q = {n: st.q for n, st in slots.items() if tree.children[n]}
    return tree

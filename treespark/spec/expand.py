"""One request's draft tree on the host, node by node: the reference for the engine.

``expand`` grows the same tree the engine grows in batched device waves
(``treespark.spec.select`` holds the rule and ``treespark.spec.drafting`` the device calls),
from a ``Proposal`` that gives the drafter's logits under one parent. It draws every
random event through a ``Sampler`` (``categorical`` for each sibling, without
replacement), so the exact-enumeration tests can branch on every outcome, and it keeps
each opened node's drawing distribution on the tree for ``verify_sampled``.

* T = 0: a node's children are the top-k of q(. | parent, depth) (q at T = 1).
* T > 0: siblings are drawn without replacement from q at the drafting temperature
  (``Calibration.draft_temperature``: T times the calibration's ``temperature_scale``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration
from treespark.spec.sampling import Sampler, draft_probs
from treespark.spec.select import TOP_M, Slots, TreeBuilder, slot_values
from treespark.spec.tree import DraftTree


class Proposal(Protocol):
    """What the drafter offers the expander for one request and one round."""

    max_depth: int
    draft_to_target: torch.Tensor | None  # [Vd] token id of each draft index; None = identity

    def logits(self, parent_token: int, depth: int) -> torch.Tensor:
        """Drafter logits over its vocabulary for a child at ``depth`` (1-based) of a
        node holding ``parent_token``: U_depth + W2 . W1[parent]."""
        ...


def open_on_host(q: torch.Tensor, k: int, temperature: float, cal: Calibration,
                 sampler: Sampler) -> Slots:
    """The slots of one node whose children are drawn from ``q`` ([Vd] float64)."""
    m = min(TOP_M, q.numel())
    top = q.topk(m)
    drawn = None
    if temperature > 0:
        drawn, rest = [], q.clone()
        for _ in range(min(k, int((q > 0).sum()))):
            x = sampler.categorical(rest / rest.sum())
            drawn.append((x, float(q[x])))
            rest[x] = 0.0
    return slot_values(top.values.tolist(), top.indices.tolist(), drawn, cal, k, q.numel())


def expand(
    proposal: Proposal,
    root_token: int,
    budget: Budget,
    calibration: Calibration,
    temperature: float,
    sampler: Sampler,
    *,
    max_depth: int | None = None,
) -> DraftTree:
    """Grow one draft tree under ``budget`` (see ``treespark.spec.select``)."""
    cal = calibration.at(temperature)
    drawn_at = calibration.draft_temperature(temperature)
    limit = proposal.max_depth if max_depth is None else min(proposal.max_depth, max_depth)
    d2t = proposal.draft_to_target
    builder = TreeBuilder(root_token, budget, limit, None if d2t is None else d2t.tolist())
    dists: dict[int, torch.Tensor] = {}
    while opens := builder.to_open():
        for n in opens:
            q = draft_probs(proposal.logits(builder.token(n), builder.nodes[n].depth + 1),
                            drawn_at).to(torch.float64)
            q = q / q.sum()
            dists[n] = q
            builder.open(n, open_on_host(q, budget.branch_cap, temperature, cal, sampler))
    tree, keep = builder.finish()
    tree.draft_to_target = d2t
    tree.child_q = {i: dists[c] for i, c in enumerate(keep) if tree.children[i]}
    return tree

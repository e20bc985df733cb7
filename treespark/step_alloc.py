"""The engine's per-step allocation: how much each step drafts and verifies.

The maths is ``treespark.pricing.allocate`` (numpy, no model); this is its engine side,
two calls per decode step:

* before drafting, ``drafting`` caps each row's drafting budget at the pad
  ``plan_drafting`` finds worth drafting (drafting priced too) for rows whose trees
  score like the replica's recent ones (a running mean, rank by rank, of the drafted
  trees' scores: what a tree is worth here, not one round's luck); a pad of 0 is plain decoding,
  no drafter call, but for a small probe every ``probe_every`` plain steps, so the
  forecasts follow the traffic;
* after drafting, ``cut`` hands every row's candidate scores to ``allocate`` with the
  seconds drafting took, and cuts each tree to its share (``RoundDraft.trimmed``).

Rows with a budget of their own (``Engine.add_request(budget=...)``) are left alone.
The engine's budget is the drafting budget: its theta the floor price (the controller's),
its node_cap and branch_cap the most that may be drafted. Nothing a step draws moves
what that step drafts or how a T > 0 row is cut (both come from history), so the
draft stays lossless.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from treespark.budget import Budget
from treespark.drafting import RoundDraft
from treespark.pricing.allocate import Allocation, DraftPlan, StepCosts, allocate, plan_drafting


@dataclass
class StepAllocator:
    costs: StepCosts
    last: Allocation | None = None
    plan: DraftPlan | None = None
    policy_s: float = 0.0                      # seconds of this step's two calls
    probe_every: int = 32                      # plain steps between two probes (a 4-node draft)
    _plain_steps: int = 0
    profile_decay: float = 0.9                 # weight of the past in the per-rank mean of drafted trees
    _history: dict[str, list[float]] = field(default_factory=dict)   # each T > 0 row's last candidates
    _profile: list[float] | None = None        # drafted trees' scores by rank (best first), a running mean

    def drafting(self, ids: Sequence[str], budgets: Sequence[Budget], follows: Sequence[bool],
                 floor: float) -> list[Budget]:
        """Each row's drafting budget for this step: ``budgets[i]`` with its node_cap cut to
        twice the planned pad (room to grow), or plain decoding where nothing pays."""
        t0 = time.perf_counter()
        if self._profile is None:
            self.plan, self.policy_s = None, time.perf_counter() - t0
            return list(budgets)
        self.plan = plan_drafting([self._profile] * len(ids), self.costs, floor=floor)
        cap = 2 * self.plan.pad
        self._plain_steps = self._plain_steps + 1 if cap == 0 else 0
        if cap == 0 and self._plain_steps % self.probe_every == 0:
            cap = 4   # the forecasts are only as new as the last draft: refresh them now and then
        out = [Budget(b.theta, min(b.node_cap, cap), b.branch_cap) if f and b.node_cap > cap else b
               for b, f in zip(budgets, follows, strict=True)]
        self.policy_s = time.perf_counter() - t0
        return out

    def cut(self, ids: Sequence[str], temperatures: Sequence[float], follows: Sequence[bool],
            drafted: RoundDraft, floor: float) -> RoundDraft:
        """``drafted`` cut for this step. ids / temperatures: the rows' requests;
        follows[i]: row i runs under the engine's budget; floor: the price no verified
        node may score below. The drafting already spent is priced from the table, not
        the clock, so a seeded batch replays the same cuts."""
        t0 = time.perf_counter()
        sampled = [t > 0 for t in temperatures]
        c = self.costs
        draft_s = c.draft_base_s + c.draft_row_s * len(ids) + c.draft_node_s * sum(len(s) for s in drafted.scores)
        alloc = allocate(drafted.scores, c, draft_s=draft_s, floor=floor, sampled=sampled,
                         proxies=[self._history.get(i) for i in ids])
        history = {i: s for i, s in zip(ids, drafted.scores, strict=True) if s}
        self._history = {i: history.get(i, self._history.get(i)) for i in ids
                         if i in history or i in self._history}
        n = self.costs.max_nodes
        for s in drafted.scores:
            ranked = sorted(s, reverse=True)[:n]
            ranked += [0.0] * (n - len(ranked))
            self._profile = ranked if self._profile is None else \
                [self.profile_decay * p + (1 - self.profile_decay) * x for p, x in zip(self._profile, ranked, strict=True)]
        counts = [c if f else t.size for c, f, t in zip(alloc.counts, follows, drafted.trees, strict=True)]
        out = drafted if all(c >= t.size for c, t in zip(counts, drafted.trees, strict=True)) \
            else drafted.trimmed(counts)
        self.last = alloc
        self.policy_s += time.perf_counter() - t0
        return out

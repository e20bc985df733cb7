"""The engine's per-step allocation: how much each step drafts and verifies.

The maths is ``treespark.pricing.allocate`` (numpy, no model; its argmax in one native
call here, ``treespark.kernels.best``, the same doubles); this is its engine side, two
calls per decode step:

* before drafting, ``drafting`` caps each row's drafting budget at the cap (``draft_cap``:
  twice the pad, room to grow) of the pad ``plan_drafting`` finds worth drafting (drafting
  priced too, at that cap) for rows whose trees score like the replica's recent ones (a
  running mean, rank by rank, of the drafted trees' scores, aged by plain steps as well:
  what a tree is worth here now, not one round's luck); a pad of 0 is plain decoding,
  no drafter call, but for a small probe now and then, so the forecasts follow the
  traffic: a ``PROBE_NODES``-node draft of every row, as rarely as keeps its cost (the
  padded verify and the drafting over plain steps, priced on ``costs``) at ``probe_share``
  of plain decoding's time: every ~56 plain steps at one row on the served default's table
  (two-core EPYC, bfloat16 weights), ~400 at 4-16 rows (a probe
  every 32 plain steps had cost ~5.6 % at 16 rows, where a probe step is ~2.8x a plain one);
* after drafting, ``cut`` hands every row's candidate scores to ``allocate`` with the
  seconds drafting took, and cuts each tree to its share (``RoundDraft.trimmed``).

With a ``fit`` (``treespark.pricing.costfit.CostFit``), ``observe`` feeds it every decode
step's measured stage seconds against what ``table`` (the startup table) predicted, and
every ``refit_every`` steps ``costs`` (what the two calls price on) becomes the table
corrected by the fit: the prices follow what steps cost in service, not what they cost
alone at startup. Without one, ``costs`` is the table.

``policy_s``, the allocation's own cost, is this thread's CPU time (``time.thread_time``):
the work the two calls do. A wall clock would add whatever the OS gave other processes
meanwhile, and on a shared host one preemption inside a sub-millisecond call is several
times the call itself.

Rows with a budget of their own (``Engine.add_request(budget=...)``) are left alone.
The engine's budget is the drafting budget: its theta the controller's price,
its node_cap and branch_cap the most that may be drafted. Nothing a step draws moves
what that step drafts or how a T > 0 row is cut (both come from history), so the
draft stays lossless.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from treespark.kernels.best import ranked_argmax
from treespark.kernels.native import library
from treespark.pricing.allocate import (
    Allocation,
    Best,
    BestFn,
    DraftPlan,
    StepCosts,
    allocate,
    best_allocation,
    draft_cap,
    plan_drafting,
)
from treespark.pricing.costfit import CostFit, predict_step
from treespark.spec.budget import Budget
from treespark.spec.drafting import RoundDraft
from treespark.spec.params import StepStats

PROBE_NODES = 4   # a probe drafts up to this many nodes a row


def native_best(scores: Sequence[Sequence[float]], costs: StepCosts, draft_s: float, theta: float,
                ahead: bool = False) -> Best:
    """``best_allocation``'s argmax in one native call (``treespark.kernels.best``): the
    same doubles (an empty batch: ``best_allocation``)."""
    if not scores:
        return best_allocation(scores, costs, draft_s, theta, ahead)
    n, bs = costs.max_nodes, len(scores)
    lens = [min(len(s), n) for s in scores]
    flat = np.array([x for s, k in zip(scores, lens, strict=True) for x in s[:k]], dtype=np.float64)
    return Best(*ranked_argmax(flat, np.asarray(lens, dtype=np.int64), n, max(theta, 1e-12), costs.verify_row(bs),
                               costs.drafting_by_pad(bs) if ahead else None, draft_s, costs.node_s))


def engine_best() -> BestFn:
    """The argmax a replica's allocation runs: ``native_best`` where the kernels are
    built, else ``best_allocation``."""
    return native_best if library() is not None else best_allocation


@dataclass
class StepAllocator:
    costs: StepCosts                           # what the allocation prices on
    fit: CostFit | None = None                 # online correction of the table from measured steps
    refit_every: int = 16                      # steps between two corrections of ``costs``
    table: StepCosts | None = None             # the table as measured (default: ``costs`` as given)
    last: Allocation | None = None
    plan: DraftPlan | None = None
    policy_s: float = 0.0                      # CPU seconds of this step's two calls (and observe)
    probe_share: float = 0.01                  # the most of plain decoding's time the probes take
    best: BestFn = field(default_factory=engine_best)   # the argmax both calls run (the native one where built)
    _plain_steps: int = 0
    profile_decay: float = 0.9                 # weight of the past in the per-rank mean, per drafted tree and plain step
    _history: dict[str, list[float]] = field(default_factory=dict)   # each T > 0 row's last candidates
    _profile: list[float] | None = None        # drafted trees' scores by rank (best first), a running mean
    _profile_version: int = 0                  # how many times the profile has moved
    _aged: int = 0                             # plain steps since the profile last moved
    _planned: tuple | None = None              # (what the last plan was made on, the plan): plain steps replan nothing
    _drafted_cap: int = 0                      # the most nodes this step let a row draft
    _observe_s: float = 0.0                    # the last ``observe``'s seconds

    def __post_init__(self) -> None:
        if self.table is None:
            self.table = self.costs

    @property
    def observes(self) -> bool:
        """Whether ``observe`` uses the steps (a ``fit`` to feed)."""
        return self.fit is not None

    def observe(self, stats: StepStats) -> None:
        """One decode step done: its measured stage seconds against the table's
        prediction (``fit``), and ``costs`` corrected every ``refit_every`` steps."""
        if self.fit is None or self.table is None or stats.prefill_tokens:
            return    # (a step with prefill chunks in its verify forward is not a decode step's cost)
        t0 = time.thread_time()
        drafted = stats.draft_waves > 0
        pred = predict_step(self.table, stats.batch_size, self._drafted_cap if drafted else 0, stats.tree_sizes)
        # the drafting stage includes this allocation's own seconds: priced as drafting
        self.fit.observe(pred, stats.draft_s if drafted else 0.0, stats.verify_s, rows=stats.batch_size,
                         nodes=sum(stats.tree_sizes))
        if self.fit.steps % self.refit_every == 0:
            self.costs = self.fit.corrected(self.table)
        self._observe_s = time.thread_time() - t0     # counted in the next step's policy_s

    def drafting(self, ids: Sequence[str], budgets: Sequence[Budget], follows: Sequence[bool],
                 theta: float) -> list[Budget]:
        """Each row's drafting budget for this step: ``budgets[i]`` with its node_cap cut to
        the planned pad's ``draft_cap``, or plain decoding where nothing pays."""
        t0 = time.thread_time()
        observed, self._observe_s = self._observe_s, 0.0
        if self._profile is None:
            self.plan, self.policy_s = None, time.thread_time() - t0 + observed
            self._drafted_cap = max((b.node_cap for b in budgets), default=0)
            return list(budgets)
        key = (len(ids), theta, id(self.costs), self._profile_version)
        if self._planned is None or self._planned[0] != key:   # else nothing it plans on has moved
            self._planned = key, plan_drafting([self._profile] * len(ids), self.costs, theta=theta, best=self.best)
        self.plan = self._planned[1]
        cap = draft_cap(self.plan.pad)
        self._plain_steps = self._plain_steps + 1 if cap == 0 else 0
        if cap == 0 and self._plain_steps % self.probe_every(len(ids)) == 0:
            cap = PROBE_NODES   # the forecasts are only as new as the last draft: refresh them now and then
        self._aged += cap == 0
        out = [Budget(b.theta, min(b.node_cap, cap), b.branch_cap) if f and b.node_cap > cap else b
               for b, f in zip(budgets, follows, strict=True)]
        self._drafted_cap = max((b.node_cap for b in out), default=0)
        self.policy_s = time.thread_time() - t0 + observed
        return out

    def probe_every(self, bs: int) -> int:
        """Plain steps between two probes at ``bs`` rows: a probe step's extra seconds (the
        verify padded to ``PROBE_NODES + 1`` tokens, the drafting of every row) over
        ``probe_share`` of a plain step's, on ``costs``."""
        c = self.costs
        row = c.verify_row(max(bs, 1))
        extra = row[min(PROBE_NODES, len(row) - 1)] - row[0] + c.drafting_s(bs, PROBE_NODES)
        return max(1, math.ceil(extra / (self.probe_share * row[0]))) if row[0] > 0 else 1

    def cut(self, ids: Sequence[str], temperatures: Sequence[float], follows: Sequence[bool],
            drafted: RoundDraft, theta: float) -> RoundDraft:
        """``drafted`` cut for this step. ids / temperatures: the rows' requests;
        follows[i]: row i runs under the engine's budget; theta: the price no verified
        node may score below. The drafting already spent is priced from ``costs``, not
        this step's clock: without a ``fit``, a seeded batch replays the same cuts."""
        t0 = time.thread_time()
        sampled = [t > 0 for t in temperatures]
        c = self.costs
        draft_s = c.drafting_s(len(ids), self._drafted_cap)
        alloc = allocate(drafted.scores, c, draft_s=draft_s, theta=theta, sampled=sampled,
                         proxies=[self._history.get(i) for i in ids], best=self.best)
        history = {i: s for i, s in zip(ids, drafted.scores, strict=True) if s}
        self._history = {i: history.get(i, self._history.get(i)) for i in ids
                         if i in history or i in self._history}
        n = self.costs.max_nodes
        trees = [s for s in drafted.scores if s]
        if trees:
            # the step's trees by rank, each row weighed alike (blended one after another, the
            # first row of a probe after a long plain run was most of the forecast: one row's
            # luck set the plan for the next few hundred steps)
            ranked = [0.0] * n
            for s in trees:
                for i, x in enumerate(sorted(s, reverse=True)[:n]):
                    ranked[i] += x / len(trees)
            # they count as many drafted trees, and plain steps age the profile as drafted trees
            # do: a probe after a long plain run is most of what is known now, not a tenth of it
            # (a stale low forecast kept a replica plain through probe after probe)
            keep = self.profile_decay ** (len(trees) + self._aged)
            self._aged = 0
            self._profile = ranked if self._profile is None else \
                [keep * p + (1 - keep) * x for p, x in zip(self._profile, ranked, strict=True)]
            self._profile_version += 1
        counts = [c if f else t.size for c, f, t in zip(alloc.counts, follows, drafted.trees, strict=True)]
        out = drafted if all(c >= t.size for c, t in zip(counts, drafted.trees, strict=True)) \
            else drafted.trimmed(counts)
        self.last = alloc
        self.policy_s += time.thread_time() - t0
        return out

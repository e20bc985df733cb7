"""Speculation policies: which ``Budget`` a replica should run under a given load.

TreeSpark prices one verified draft node by ``theta`` (see ``treespark.spec.budget``):
at light load verification is nearly free, so trees may grow wide and deep; as
the batch grows the target forward becomes compute-bound, every extra node costs
real time, and the tree should shrink to a chain and finally to plain decoding.

A policy maps a ``LoadSnapshot`` (what the cluster controller aggregates from
replica heartbeats, or what one replica sees of itself when the controller is
gone) to a ``Budget`` for one replica. ``LadderPolicy`` is the simplest useful
one: a ladder of budgets indexed by the load per replica (running plus queued
requests), the serving counterpart of the hand-measured theta-by-batch-size
ladder of the TreeSpark reference code. ``CostModelPolicy`` replaces the ladder
with a price derived from the measured forward time T(bs, k) and the acceptance
the replicas observe (``treespark.pricing.costmodel``).

This module is pure: no Ray, no HTTP, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from treespark.pricing.costmodel import (
    AcceptanceProfile,
    AcceptanceStats,
    CostModel,
    Plan,
    plan_budget,
)
from treespark.spec.budget import DEFAULT_BRANCH_CAP, Budget


@dataclass(frozen=True)
class LoadSnapshot:
    """Load of the serving cluster (or of one replica) at one moment.

    * ``replicas``      replicas currently reporting (>= 1 for a meaningful snapshot);
    * ``active``        requests running in the engines' batches, summed over replicas;
    * ``queued``        requests admitted but waiting for a batch slot, summed;
    * ``acceptance``    recent rounds per tree size and the draft tokens they accepted
                        (None when unknown): what a tree of n nodes buys right now;
    * ``draft_node_s``  drafting seconds per draft node, fitted from the replicas' draft
                        times (None when unknown);
    * ``queue_growth``  how fast the cluster's queue grows, requests per second (0 when
                        flat, shrinking or unknown).
    """

    replicas: int
    active: int
    queued: int
    acceptance: AcceptanceStats | None = None
    draft_node_s: float | None = None
    queue_growth: float = 0.0

    def __post_init__(self) -> None:
        for name in ("replicas", "active", "queued"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"LoadSnapshot.{name} must be an integer >= 0, got {value!r}")

    @property
    def load_per_replica(self) -> float:
        """Requests (running + queued) per replica: the batch each replica will run."""
        return (self.active + self.queued) / max(self.replicas, 1)

    @classmethod
    def idle(cls, replicas: int = 1) -> LoadSnapshot:
        return cls(replicas=replicas, active=0, queued=0)


@runtime_checkable
class BudgetPolicy(Protocol):
    """Anything that prices speculation for one replica under a cluster load."""

    def budget_for(self, load: LoadSnapshot, replica_id: str) -> Budget: ...


@dataclass(frozen=True)
class Rung:
    """One step of a ladder: ``budget`` applies while load per replica <= ``max_load``."""

    max_load: float
    budget: Budget


def _default_rungs() -> tuple[Rung, ...]:
    return (
        Rung(2.0, Budget(theta=0.02, node_cap=32, branch_cap=4)),  # light: wide adaptive tree
        Rung(6.0, Budget(theta=0.10, node_cap=12, branch_cap=2)),  # medium: narrow tree
        Rung(16.0, Budget(theta=0.25, node_cap=4, branch_cap=1)),  # heavy: short chain
        Rung(math.inf, Budget(theta=1.0, node_cap=0, branch_cap=1)),  # very heavy: off
    )


@dataclass(frozen=True)
class LadderPolicy:
    """A batch-size ladder of budgets.

    ``rungs`` are sorted by ``max_load``; the first rung whose ``max_load`` is at
    least the snapshot's load per replica wins, and load beyond the last rung
    gets the last rung. The ladder must be monotone — ``theta`` non-decreasing,
    ``node_cap`` and ``branch_cap`` non-increasing as load rises — so more load
    never buys a bigger tree.
    """

    rungs: tuple[Rung, ...] = field(default_factory=_default_rungs)

    def __post_init__(self) -> None:
        rungs = tuple(self.rungs)
        if not rungs:
            raise ValueError("LadderPolicy needs at least one rung")
        for lo, hi in zip(rungs, rungs[1:], strict=False):
            if not hi.max_load > lo.max_load:
                raise ValueError(f"LadderPolicy rungs must have increasing max_load, got {lo.max_load} then {hi.max_load}")
            if hi.budget.theta < lo.budget.theta:
                raise ValueError("LadderPolicy must be monotone: theta may not fall as load rises")
            if hi.budget.node_cap > lo.budget.node_cap or hi.budget.branch_cap > lo.budget.branch_cap:
                raise ValueError("LadderPolicy must be monotone: node_cap/branch_cap may not grow as load rises")
        object.__setattr__(self, "rungs", rungs)

    @classmethod
    def from_thresholds(cls, thresholds: Sequence[float], budgets: Sequence[Budget]) -> LadderPolicy:
        """``budgets[i]`` applies up to ``thresholds[i]``; ``budgets`` has one more entry (the top rung)."""
        if len(budgets) != len(thresholds) + 1:
            raise ValueError(f"need len(budgets) == len(thresholds) + 1, got {len(budgets)} and {len(thresholds)}")
        bounds = [float(t) for t in thresholds] + [math.inf]
        return cls(tuple(Rung(t, b) for t, b in zip(bounds, budgets, strict=True)))

    def budget_for(self, load: LoadSnapshot, replica_id: str = "") -> Budget:
        x = load.load_per_replica
        for rung in self.rungs:
            if x <= rung.max_load:
                return rung.budget
        return self.rungs[-1].budget


@dataclass(frozen=True)
class FixedPolicy:
    """The same budget whatever the load (baselines: a fixed chain, always off, ...)."""

    budget: Budget

    def budget_for(self, load: LoadSnapshot, replica_id: str = "") -> Budget:
        return self.budget


@dataclass(frozen=True)
class CostModelPolicy:
    """theta from a measured cost model (see ``treespark.pricing.costmodel.plan_budget``).

    Per replica: the batch it will run (running + queued, at most ``max_batch`` rows) and
    the requests waiting beyond it price the draft nodes on ``cost`` (or on ``replica_costs[replica_id]``, so replicas on different
    hardware get their own prices from one controller). What a tree of ``n`` nodes buys
    is ``prior`` refined by the snapshot's ``acceptance`` (``prior_weight`` pseudo-rounds
    per size). Plain decoding comes out as ``theta >= 1`` with ``node_cap = 0``: the
    expander then returns an empty tree.
    """

    cost: CostModel
    prior: AcceptanceProfile = field(default_factory=AcceptanceProfile.saturating)
    max_nodes: int = 32
    max_branch: int = DEFAULT_BRANCH_CAP
    queue_weight: float = 1.0
    prior_weight: float = 200.0
    min_gain: float = 1.0
    draft_node_s: float = 0.0      # drafting seconds per node until the controller has learned it
    max_batch: int | None = None
    replica_costs: tuple[tuple[str, CostModel], ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError("CostModelPolicy.max_batch must be >= 1 or None")
        if self.max_nodes < 0 or self.max_branch < 1:
            raise ValueError("CostModelPolicy needs max_nodes >= 0 and max_branch >= 1")
        if self.queue_weight < 0 or self.prior_weight < 0 or self.min_gain < 0:
            raise ValueError("CostModelPolicy weights must be >= 0")

    def cost_for(self, replica_id: str) -> CostModel:
        return dict(self.replica_costs).get(replica_id, self.cost)

    def profile(self, load: LoadSnapshot) -> AcceptanceProfile:
        return AcceptanceProfile.blend(self.prior, load.acceptance, self.prior_weight)

    def plan(self, load: LoadSnapshot, replica_id: str = "") -> Plan:
        r = max(load.replicas, 1)
        return plan_budget(self.cost_for(replica_id), self.profile(load), active=load.active / r,
                           queued=load.queued / r, max_batch=self.max_batch, max_nodes=self.max_nodes, max_branch=self.max_branch,
                           queue_weight=self.queue_weight, min_gain=self.min_gain,
                           node_s=self.draft_node_s if load.draft_node_s is None else load.draft_node_s)

    def budget_for(self, load: LoadSnapshot, replica_id: str = "") -> Budget:
        p = self.plan(load, replica_id)
        if p.nodes == 0:
            return Budget(theta=max(p.theta, 1.0), node_cap=0, branch_cap=1)
        return Budget(theta=p.theta, node_cap=p.nodes, branch_cap=p.branch_cap)


@dataclass(frozen=True)
class PerStepPolicy:
    """The engines allocate every step on their own cost tables (``treespark.engine.step_alloc``);
    the cluster sets the *price theta*: the least score a verified node must have.

    With no queue the theta is 0 and the engines' allocation alone decides. Requests
    waiting beyond the batches (``w`` per replica, over ``max_batch`` rows) or a queue
    that keeps growing (``g`` requests per second) put pressure on the cluster,

        p = queue_weight * w / max_batch + trend_weight * g / max_batch,

    and the theta ``p / (1 + p)`` (at most ``max_theta``) makes every step verify only
    nodes likely to pay, so admission wins over speculation. The budget a replica gets is
    its drafting budget: ``theta`` = the theta, ``node_cap`` / ``branch_cap`` the most
    that may be drafted (the engine drafts less when its plan says so)."""

    max_nodes: int = 32
    max_branch: int = DEFAULT_BRANCH_CAP
    max_batch: int | None = None
    queue_weight: float = 1.0
    trend_weight: float = 1.0
    max_theta: float = 0.95

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.max_branch < 1:
            raise ValueError("PerStepPolicy needs max_nodes >= 0 and max_branch >= 1")
        if self.queue_weight < 0 or self.trend_weight < 0 or not 0 <= self.max_theta <= 1:
            raise ValueError("PerStepPolicy weights must be >= 0 and max_theta in [0, 1]")

    def theta(self, load: LoadSnapshot) -> float:
        r = max(load.replicas, 1)
        batch = float(self.max_batch or 1)
        waiting = max(load.load_per_replica - batch, 0.0) if self.max_batch else load.queued / r
        growth = max(load.queue_growth, 0.0) if waiting > 0 else 0.0   # a queue building beyond the batches
        p = self.queue_weight * waiting / batch + self.trend_weight * growth / r / batch
        return min(p / (1.0 + p), self.max_theta)

    def budget_for(self, load: LoadSnapshot, replica_id: str = "") -> Budget:
        return Budget(theta=self.theta(load), node_cap=self.max_nodes, branch_cap=self.max_branch)

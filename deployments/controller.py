"""The cluster controller: one named, detached Ray actor that prices speculation.

Replicas call ``report`` every ``heartbeat_s`` with their load and recent tree
statistics; the reply carries the budget the replica must run (so a budget change
reaches every replica within one heartbeat, well under a second). The controller

* registers a replica on its first report (also after a controller restart, whose
  state is empty: replicas simply re-register with their next heartbeat);
* drops replicas silent for ``heartbeat_timeout_s``;
* aggregates the live reports into a ``LoadSnapshot`` and asks the ``BudgetPolicy``
  for each replica's budget (an operator ``override`` pins one budget for all);
* keeps cluster counters (monotone across dropped replicas) and calibration records
  (logit q, accepted) and, if enabled, refits the calibration (a, b) online.

All the math is in ``ControllerState`` and free functions, testable without Ray;
``Controller`` is the thin actor around it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from treespark.budget import Budget
from treespark.policy import BudgetPolicy, LoadSnapshot

COUNTERS = (
    "requests",
    "requests_aborted",
    "prompt_tokens",
    "generation_tokens",
    "rounds",
    "draft_tokens",
    "accepted_tokens",
    "steps",
)


@dataclass(frozen=True)
class TreeStats:
    """Means over the engine steps since the previous heartbeat (0 when idle)."""

    steps: int = 0
    batch_size: float = 0.0
    mean_tree_size: float = 0.0
    mean_width: float = 0.0
    mean_depth: float = 0.0
    accepted_per_round: float = 0.0
    step_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    theta: float = 0.0


@dataclass(frozen=True)
class ReplicaReport:
    replica_id: str
    active: int
    queued: int
    tokens_per_s: float
    tree: TreeStats
    budget: dict[str, float]
    budget_source: str
    counters: dict[str, float]
    calibration_records: tuple[tuple[float, bool], ...] = ()
    calibration: tuple[float, float] | None = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ReplicaReport:
        d = dict(d)
        d["tree"] = TreeStats(**d.get("tree", {}))
        d["calibration_records"] = tuple((float(x), bool(y)) for x, y in d.get("calibration_records", ()))
        if d.get("calibration") is not None:
            d["calibration"] = tuple(d["calibration"])
        return cls(**d)


def budget_to_wire(b: Budget) -> dict[str, float]:
    return {"theta": b.theta, "node_cap": b.node_cap, "branch_cap": b.branch_cap}


def budget_from_wire(d: Mapping[str, Any]) -> Budget:
    return Budget(theta=float(d["theta"]), node_cap=int(d["node_cap"]), branch_cap=int(d["branch_cap"]))


# -- pure functions ---------------------------------------------------------------


def aggregate_load(reports: Iterable[ReplicaReport]) -> LoadSnapshot:
    """Cluster load: sums of active/queued/tokens per second, mean step time of the
    replicas that stepped."""
    reports = list(reports)
    steps = [r.tree.step_s for r in reports if r.tree.steps > 0]
    return LoadSnapshot(
        replicas=len(reports),
        active=sum(r.active for r in reports),
        queued=sum(r.queued for r in reports),
        step_s=sum(steps) / len(steps) if steps else 0.0,
        tokens_per_s=sum(r.tokens_per_s for r in reports),
    )


def assign_budgets(
    policy: BudgetPolicy, load: LoadSnapshot, replica_ids: Iterable[str], override: Budget | None = None
) -> dict[str, Budget]:
    return {rid: override if override is not None else policy.budget_for(load, rid) for rid in replica_ids}


def expired(last_seen: Mapping[str, float], now: float, timeout_s: float) -> list[str]:
    return [rid for rid, t in last_seen.items() if now - t > timeout_s]


def fit_calibration(records: Sequence[tuple[float, bool]], iters: int = 25, l2: float = 1e-3) -> tuple[float, float]:
    """Logistic regression ``P(accepted) = sigmoid(a * x + b)`` by Newton's method on
    (x = logit q, accepted) records, a small ridge keeping it finite on separable data."""
    n = len(records)
    if n == 0:
        raise ValueError("no calibration records")
    a, b = 1.0, 0.0
    for _ in range(iters):
        ga = gb = haa = hab = hbb = 0.0
        for x, y in records:
            z = max(min(a * x + b, 35.0), -35.0)
            p = 1.0 / (1.0 + math.exp(-z))
            r = p - (1.0 if y else 0.0)
            w = p * (1.0 - p)
            ga += r * x
            gb += r
            haa += w * x * x
            hab += w * x
            hbb += w
        ga, gb = ga / n + l2 * a, gb / n + l2 * b
        haa, hab, hbb = haa / n + l2, hab / n, hbb / n + l2
        det = haa * hbb - hab * hab
        if det <= 1e-12:
            break
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        a, b = a - da, b - db
        if abs(da) + abs(db) < 1e-8:
            break
    return a, b


@dataclass
class _Entry:
    report: ReplicaReport
    last_seen: float
    registered_at: float
    budget: Budget
    version: int = 0


@dataclass
class ControllerState:
    """Everything the controller knows, and the rules it applies. ``clock`` is injectable."""

    policy: BudgetPolicy
    heartbeat_timeout_s: float = 2.0
    online_calibration: bool = False
    min_calibration_records: int = 2000
    clock: Callable[[], float] = time.monotonic
    replicas: dict[str, _Entry] = field(default_factory=dict)
    override: Budget | None = None
    departed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    records: deque = field(default_factory=lambda: deque(maxlen=20000))
    calibration: tuple[float, float] | None = None
    registrations: int = 0
    dropped: int = 0
    started_at: float = field(default_factory=time.time)
    _records_since_fit: int = 0

    def report(self, report: ReplicaReport) -> dict[str, Any]:
        """Record one heartbeat; returns ``{"budget", "registered", "calibration"}`` for the replica."""
        now = self.clock()
        self.prune(now)
        entry = self.replicas.get(report.replica_id)
        registered = entry is None
        if registered:
            self.registrations += 1
            entry = _Entry(report, now, now, budget_from_wire(report.budget))
            self.replicas[report.replica_id] = entry
        entry.report, entry.last_seen = report, now
        self.records.extend(report.calibration_records)
        self._records_since_fit += len(report.calibration_records)
        self._refit()
        self._reassign()
        return {
            "budget": budget_to_wire(self.replicas[report.replica_id].budget),
            "registered": registered,
            "calibration": self.calibration if self.online_calibration else None,
        }

    def prune(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        gone = expired({k: e.last_seen for k, e in self.replicas.items()}, now, self.heartbeat_timeout_s)
        for rid in gone:
            for k in COUNTERS:
                self.departed[k] += self.replicas[rid].report.counters.get(k, 0.0)
            del self.replicas[rid]
        self.dropped += len(gone)
        if gone:
            self._reassign()
        return gone

    def load(self) -> LoadSnapshot:
        return aggregate_load(e.report for e in self.replicas.values())

    def set_override(self, budget: Budget | None) -> None:
        self.override = budget
        self._reassign()

    def _reassign(self) -> None:
        budgets = assign_budgets(self.policy, self.load(), self.replicas, self.override)
        for rid, b in budgets.items():
            e = self.replicas[rid]
            if b != e.budget:
                e.budget, e.version = b, e.version + 1

    def _refit(self) -> None:
        if self.online_calibration and len(self.records) >= self.min_calibration_records and self._records_since_fit >= self.min_calibration_records // 4:
            self.calibration = fit_calibration(list(self.records))
            self._records_since_fit = 0

    def counters(self) -> dict[str, float]:
        total = dict(self.departed)
        for e in self.replicas.values():
            for k in COUNTERS:
                total[k] += e.report.counters.get(k, 0.0)
        return total

    def status(self) -> dict[str, Any]:
        now = self.clock()
        self.prune(now)
        acc = [y for _, y in self.records]
        return {
            "replicas": {
                rid: {
                    "budget": budget_to_wire(e.budget),
                    "applied_budget": e.report.budget,
                    "budget_source": e.report.budget_source,
                    "active": e.report.active,
                    "queued": e.report.queued,
                    "tokens_per_s": e.report.tokens_per_s,
                    "last_seen_s": now - e.last_seen,
                    "registered_s": now - e.registered_at,
                    "calibration": e.report.calibration,
                    **asdict(e.report.tree),
                }
                for rid, e in sorted(self.replicas.items())
            },
            "cluster": asdict(self.load()),
            "override": budget_to_wire(self.override) if self.override else None,
            "calibration": {
                "records": len(acc),
                "acceptance_rate": sum(acc) / len(acc) if acc else None,
                "online": self.online_calibration,
                "fitted": self.calibration,
            },
            "registrations": self.registrations,
            "dropped": self.dropped,
            "uptime_s": time.time() - self.started_at,
            "counters": self.counters(),
        }


class Controller:
    """The Ray actor (``ray.remote`` applied in ``get_or_create_controller``)."""

    def __init__(self, args: dict[str, Any]) -> None:
        from deployments.config import AppArgs

        a = AppArgs.model_validate(args)
        self.state = ControllerState(
            policy=a.policy.build(),
            heartbeat_timeout_s=a.controller.heartbeat_timeout_s,
            online_calibration=a.controller.online_calibration,
            min_calibration_records=a.controller.min_calibration_records,
        )

    def configure(self, args: dict[str, Any]) -> None:
        """A redeploy with new arguments updates the policy of a running controller."""
        from deployments.config import AppArgs

        a = AppArgs.model_validate(args)
        s = self.state
        s.policy, s.heartbeat_timeout_s = a.policy.build(), a.controller.heartbeat_timeout_s
        s.online_calibration, s.min_calibration_records = a.controller.online_calibration, a.controller.min_calibration_records
        s._reassign()

    def report(self, report: dict[str, Any]) -> dict[str, Any]:
        return self.state.report(ReplicaReport.from_wire(report))

    def set_override(self, budget: dict[str, Any] | None) -> None:
        self.state.set_override(None if budget is None else budget_from_wire(budget))

    def status(self) -> dict[str, Any]:
        return self.state.status()

    def ping(self) -> str:
        return "ok"


def get_or_create_controller(args: dict[str, Any]):
    """The controller actor handle, creating it if absent (idempotent, race-free through
    ``get_if_exists``). Detached so it outlives any one replica; restarted by Ray if it
    dies (state reset; replicas re-register on their next heartbeat)."""
    import ray

    from deployments.config import AppArgs

    c = AppArgs.model_validate(args).controller
    actor = ray.remote(Controller).options(
        name=c.name,
        namespace=c.namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=0,
        num_cpus=0,
    )
    return actor.remote(args)

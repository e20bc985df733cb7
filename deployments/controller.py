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
  (logit q, accepted) and, if enabled, refits the calibration (a, b) online: the fit is
  shrunk toward the replicas' stored calibration while records are few, and the status
  reports the ECE of the stored and of the pushed calibration on the same records;
* keeps per-round (tree size, accepted) records, so a cost-model policy learns what a
  tree of n nodes buys under the current traffic (``LoadSnapshot.acceptance``).

All the math is in ``ControllerState`` and free functions, testable without Ray;
``Controller`` is the thin actor around it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from treespark.budget import Budget
from treespark.costmodel import AcceptanceStats
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
    round_records: tuple[tuple[int, int], ...] = ()         # (tree size, accepted) per request-round
    base_calibration: tuple[float, float] | None = None     # the replica's stored (a, b)
    kv_slots_in_use: int | None = None                      # engine KV rows holding a request
    rss_bytes: int | None = None                            # the replica process's resident memory

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ReplicaReport:
        d = dict(d)
        d["tree"] = TreeStats(**d.get("tree", {}))
        d["calibration_records"] = tuple((float(x), bool(y)) for x, y in d.get("calibration_records", ()))
        if d.get("calibration") is not None:
            d["calibration"] = tuple(d["calibration"])
        if d.get("base_calibration") is not None:
            d["base_calibration"] = (float(d["base_calibration"][0]), float(d["base_calibration"][1]))
        d["round_records"] = tuple((int(n), int(a)) for n, a in d.get("round_records", ()))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})  # a newer replica's extra keys: ignored


def budget_to_wire(b: Budget) -> dict[str, float]:
    return {"theta": b.theta, "node_cap": b.node_cap, "branch_cap": b.branch_cap}


def budget_from_wire(d: Mapping[str, Any]) -> Budget:
    return Budget(theta=float(d["theta"]), node_cap=int(d["node_cap"]), branch_cap=int(d["branch_cap"]))


# -- pure functions ---------------------------------------------------------------


def aggregate_load(reports: Iterable[ReplicaReport], acceptance: AcceptanceStats | None = None,
                   draft_node_s: float | None = None) -> LoadSnapshot:
    """Cluster load: sums of active/queued/tokens per second, mean step time of the
    replicas that stepped; ``acceptance`` (the controller's recent per-round records)
    passes through to the policy."""
    reports = list(reports)
    steps = [r.tree.step_s for r in reports if r.tree.steps > 0]
    return LoadSnapshot(
        replicas=len(reports),
        active=sum(r.active for r in reports),
        queued=sum(r.queued for r in reports),
        step_s=sum(steps) / len(steps) if steps else 0.0,
        tokens_per_s=sum(r.tokens_per_s for r in reports),
        acceptance=acceptance,
        draft_node_s=draft_node_s,
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


def _sigmoid(z: float) -> float:
    z = max(min(z, 35.0), -35.0)
    return 1.0 / (1.0 + math.exp(-z))


def calibration_ece(records: Sequence[tuple[float, bool]], a: float, b: float, bins: int = 15) -> float:
    """Expected calibration error of ``sigmoid(a * x + b)`` on (x = logit q, accepted)
    records, equal-width bins (as ``treespark.calibration.expected_calibration_error``)."""
    if not records:
        return float("nan")
    n_b, p_b, y_b = [0] * bins, [0.0] * bins, [0.0] * bins
    for x, y in records:
        p = _sigmoid(a * x + b)
        i = min(int(p * bins), bins - 1)
        n_b[i] += 1
        p_b[i] += p
        y_b[i] += 1.0 if y else 0.0
    return sum(abs(y_b[i] - p_b[i]) for i in range(bins) if n_b[i]) / len(records)


def shrink_calibration(fit: tuple[float, float], base: tuple[float, float], n: int,
                       prior_records: int) -> tuple[float, float]:
    """The online fit pulled toward the stored one: weight n / (n + prior_records)."""
    w = n / (n + prior_records) if prior_records > 0 else 1.0
    return (w * fit[0] + (1 - w) * base[0], w * fit[1] + (1 - w) * base[1])


class RoundWindow:
    """The last ``maxlen`` (tree size, accepted) round records, with running per-size
    sums so ``stats()`` costs O(sizes), not O(records)."""

    def __init__(self, maxlen: int = 20000, max_nodes: int = 64) -> None:
        self.maxlen, self.max_nodes = maxlen, max_nodes
        self._q: deque = deque()
        self._counts = [0] * (max_nodes + 1)
        self._sums = [0] * (max_nodes + 1)

    def extend(self, rounds: Iterable[tuple[int, int]]) -> None:
        for n, acc in rounds:
            n = min(max(int(n), 0), self.max_nodes)
            self._q.append((n, acc))
            self._counts[n] += 1
            self._sums[n] += acc
            if len(self._q) > self.maxlen:
                m, a = self._q.popleft()
                self._counts[m] -= 1
                self._sums[m] -= a

    def __len__(self) -> int:
        return len(self._q)

    def stats(self) -> AcceptanceStats | None:
        if not self._q:
            return None
        return AcceptanceStats(tuple(self._counts), tuple(float(x) for x in self._sums))


def fit_draft_cost(points: Sequence[tuple[float, float, float]], min_points: int = 20) -> float | None:
    """Drafting seconds per draft node from heartbeat means (rows, nodes per step, draft
    seconds per step): least squares of ``draft_s = c0 + c1 * rows + c2 * nodes``; None
    while the points are too few or do not vary in nodes."""
    if len(points) < min_points:
        return None
    n = len(points)
    m = [[0.0] * 3 for _ in range(3)]
    v = [0.0] * 3
    for rows, nodes, y in points:
        x = (1.0, rows, nodes)
        for i in range(3):
            v[i] += x[i] * y
            for j in range(3):
                m[i][j] += x[i] * x[j]
    mean_nodes = m[0][2] / n
    if m[2][2] / n - mean_nodes**2 < 1.0:  # nodes barely vary: c2 is not identified
        return None
    for i in range(3):
        m[i][i] += 1e-9 * n
    # Gaussian elimination on the 3x3 normal equations
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(a[r][c]))
        a[c], a[p] = a[p], a[c]
        if abs(a[c][c]) < 1e-15:
            return None
        for r in range(3):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c], strict=True)]
    return max(a[2][3] / a[2][2], 0.0)


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
    calibration_prior_records: int = 2000   # the stored fit counts as this many records
    clock: Callable[[], float] = time.monotonic
    replicas: dict[str, _Entry] = field(default_factory=dict)
    override: Budget | None = None
    departed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    records: deque = field(default_factory=lambda: deque(maxlen=20000))
    calibration: tuple[float, float] | None = None
    calibration_report: dict[str, float] | None = None
    rounds: RoundWindow = field(default_factory=RoundWindow)
    draft_points: deque = field(default_factory=lambda: deque(maxlen=400))
    draft_node_s: float | None = None
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
        self.rounds.extend(report.round_records)
        t = report.tree
        if t.steps > 0 and t.draft_s > 0:
            self.draft_points.append((t.batch_size, t.batch_size * t.mean_tree_size, t.draft_s))
            self.draft_node_s = fit_draft_cost(self.draft_points)
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
        return aggregate_load((e.report for e in self.replicas.values()), self.rounds.stats(), self.draft_node_s)

    def set_override(self, budget: Budget | None) -> None:
        self.override = budget
        self._reassign()

    def _reassign(self) -> None:
        budgets = assign_budgets(self.policy, self.load(), self.replicas, self.override)
        for rid, b in budgets.items():
            e = self.replicas[rid]
            if b != e.budget:
                e.budget, e.version = b, e.version + 1

    def base_calibration(self) -> tuple[float, float]:
        """The stored calibration the replicas started from ((1, 0) if none reported)."""
        for e in self.replicas.values():
            if e.report.base_calibration is not None:
                return e.report.base_calibration
        return (1.0, 0.0)

    def _refit(self) -> None:
        if self.online_calibration and len(self.records) >= self.min_calibration_records and self._records_since_fit >= self.min_calibration_records // 4:
            recent = list(self.records)[-5000:]  # keeps a refit well under a heartbeat
            base = self.base_calibration()
            fit = fit_calibration(recent)
            self.calibration = shrink_calibration(fit, base, len(self.records), self.calibration_prior_records)
            self.calibration_report = {
                "records": len(recent),
                "ece_stored": calibration_ece(recent, *base),
                "ece_pushed": calibration_ece(recent, *self.calibration),
                "ece_fit": calibration_ece(recent, *fit),
                "a": self.calibration[0],
                "b": self.calibration[1],
            }
            self._records_since_fit = 0

    def _acceptance_status(self) -> dict[str, Any]:
        st = self.rounds.stats()
        if st is None:
            return {"rounds": 0, "by_tree_size": {}}
        return {"rounds": st.rounds,
                "by_tree_size": {str(n): [c, st.sums[n] / c] for n, c in enumerate(st.counts) if c}}

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
                    "kv_slots_in_use": e.report.kv_slots_in_use,
                    "rss_bytes": e.report.rss_bytes,
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
                "report": self.calibration_report,
            },
            "acceptance": self._acceptance_status(),
            "draft_node_s": self.draft_node_s,
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
            policy=a.policy.build(a.max_batch_size),
            heartbeat_timeout_s=a.controller.heartbeat_timeout_s,
            online_calibration=a.controller.online_calibration,
            min_calibration_records=a.controller.min_calibration_records,
            calibration_prior_records=a.controller.calibration_prior_records,
        )

    def configure(self, args: dict[str, Any]) -> None:
        """A redeploy with new arguments updates the policy of a running controller."""
        from deployments.config import AppArgs

        a = AppArgs.model_validate(args)
        s = self.state
        s.policy, s.heartbeat_timeout_s = a.policy.build(a.max_batch_size), a.controller.heartbeat_timeout_s
        s.online_calibration, s.min_calibration_records = a.controller.online_calibration, a.controller.min_calibration_records
        s.calibration_prior_records = a.controller.calibration_prior_records
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

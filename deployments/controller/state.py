"""The controller's state and rules, without Ray: ``ControllerState``.

Replicas report every heartbeat; the state

* registers a replica on its first report (also after a controller restart, whose
  state is empty: replicas simply re-register with their next heartbeat);
* drops replicas silent for ``heartbeat_timeout_s`` (``expired``);
* aggregates the live reports into a ``LoadSnapshot`` (``aggregate_load``) and asks the
  ``BudgetPolicy`` for each replica's budget (``assign_budgets``; an operator
  ``override`` pins one budget for all): priced on the cluster's load, or, with
  ``cluster_pricing`` off, on each replica's own (``replica_loads``: what a replica's local
  policy sees of itself), switchable at run time (``set_pricing``);
* keeps cluster counters (monotone across dropped replicas), calibration records and
  per-round (node cap, accepted) records, and refits what
  ``treespark.pricing.estimators`` learns from them;
* keeps each replica's latest Prometheus samples, and the sum of the dropped replicas'
  (``deployments.metrics.merge``), so cluster counters stay monotone; and each API
  replica's latest (``report_ingress``: its resends and stream resumes), never dropped;
* answers ``status()``, what ``GET /v1/speculation`` shows, and ``metrics_view()``, what
  ``/metrics`` renders.

``clock`` is injectable, so tests drive time by hand.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from deployments.metrics import merge
from deployments.reports import COUNTERS, ReplicaReport
from treespark.pricing.costfit import CostCell, served_ratios
from treespark.pricing.costmodel import AcceptanceStats
from treespark.pricing.estimators import (
    RoundWindow,
    ece_on_records,
    fit_ab,
    fit_draft_cost,
    shrink_calibration,
)
from treespark.pricing.policy import BudgetPolicy, LoadSnapshot
from treespark.spec.budget import Budget


def aggregate_load(reports: Iterable[ReplicaReport], acceptance: AcceptanceStats | None = None,
                   draft_node_s: float | None = None, queue_growth: float = 0.0) -> LoadSnapshot:
    """Cluster load: replicas, sums of active and queued requests; ``acceptance`` (the
    controller's recent per-round records), ``draft_node_s`` and ``queue_growth`` pass
    through to the policy."""
    reports = list(reports)
    return LoadSnapshot(
        replicas=len(reports),
        active=sum(r.active for r in reports),
        queued=sum(r.queued for r in reports),
        acceptance=acceptance,
        draft_node_s=draft_node_s,
        queue_growth=queue_growth,
    )


def queue_growth(history: Iterable[tuple[float, int]], window_s: float = 2.0) -> float:
    """Requests per second the cluster queue grew over the last ``window_s`` (least-squares
    slope of (time, queued); 0 with fewer than 3 points or a flat or shrinking queue)."""
    h = list(history)
    if not h:
        return 0.0
    h = [(t, q) for t, q in h if t >= h[-1][0] - window_s]
    if len(h) < 3:
        return 0.0
    ts = [t for t, _ in h]
    qs = [float(q) for _, q in h]
    mt, mq = sum(ts) / len(ts), sum(qs) / len(qs)
    var = sum((t - mt) ** 2 for t in ts)
    if var <= 0:
        return 0.0
    return max(sum((t - mt) * (q - mq) for t, q in zip(ts, qs, strict=True)) / var, 0.0)


def replica_loads(cluster: LoadSnapshot, reports: Mapping[str, ReplicaReport], cluster_pricing: bool = True
                  ) -> dict[str, LoadSnapshot]:
    """The load each replica is priced on: the cluster's, or (``cluster_pricing`` off) the
    replica's own running and queued requests alone, as its local policy sees itself."""
    if cluster_pricing:
        return dict.fromkeys(reports, cluster)
    return {rid: aggregate_load([r]) for rid, r in reports.items()}


def assign_budgets(
    policy: BudgetPolicy, loads: Mapping[str, LoadSnapshot], override: Budget | None = None
) -> dict[str, Budget]:
    """Each replica's budget on its load (``replica_loads``), or the override for all."""
    return {rid: override if override is not None else policy.budget_for(load, rid) for rid, load in loads.items()}


def expired(last_seen: Mapping[str, float], now: float, timeout_s: float) -> list[str]:
    return [rid for rid, t in last_seen.items() if now - t > timeout_s]


@dataclass
class _Entry:
    report: ReplicaReport
    last_seen: float
    registered_at: float
    budget: Budget
    version: int = 0
    priced_at: float = 0.0      # wall time of the last budget change (replicas time its arrival)
    sent_source: str | None = None      # the price source of the budget in the last reply
    applied_source: str | None = None   # ... of the budget the replica ran when it last reported


@dataclass
class ControllerState:
    """Everything the controller knows, and the rules it applies. ``clock`` is injectable."""

    policy: BudgetPolicy
    heartbeat_timeout_s: float = 2.0
    online_calibration: bool = True
    min_calibration_records: int = 2000
    calibration_prior_records: int = 2000   # the stored fit counts as this many records
    clock: Callable[[], float] = time.monotonic
    replicas: dict[str, _Entry] = field(default_factory=dict)
    override: Budget | None = None
    override_fixed: bool = False    # the override verified as is: replicas pause their per-step allocation
    cluster_pricing: bool = True    # price every replica on the cluster's load; off: each on its own
    departed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    departed_samples: list = field(default_factory=list)   # dropped replicas' Prometheus samples, summed
    ingress_samples: dict = field(default_factory=dict)    # API replica id -> its latest samples (cumulative)
    records: deque = field(default_factory=lambda: deque(maxlen=20000))
    calibration: tuple[float, float] | None = None
    calibration_report: dict[str, float] | None = None
    rounds: RoundWindow = field(default_factory=RoundWindow)
    draft_points: deque = field(default_factory=lambda: deque(maxlen=400))
    draft_node_s: float | None = None
    queue_history: deque = field(default_factory=lambda: deque(maxlen=256))   # (time, cluster queued)
    drift_tolerance: float = 0.1     # recent acceptance this far from the pool's: refit on the recent alone
    calibration_guard: str = ""      # why the last refit was not pushed ("" when it was)
    registrations: int = 0
    dropped: int = 0
    started_at: float = field(default_factory=time.time)
    _records_since_fit: int = 0

    def report(self, report: ReplicaReport) -> dict[str, Any]:
        """Record one heartbeat; returns ``{"budget", "allocate", "registered", "calibration"}``
        for the replica (``allocate``: whether it runs its per-step allocation on the budget)."""
        now = self.clock()
        self.prune(now)
        entry = self.replicas.get(report.replica_id)
        registered = entry is None
        if registered:
            self.registrations += 1
            entry = _Entry(report, now, now, Budget.from_wire(report.budget))
            self.replicas[report.replica_id] = entry
        entry.report, entry.last_seen = report, now
        # the replica applies a reply before it writes its next report: this report shows the last reply's price
        entry.applied_source = "local" if report.budget_source == "local" else entry.sent_source
        self.queue_history.append((now, sum(e.report.queued for e in self.replicas.values())))
        self.records.extend(report.calibration_records)
        self._records_since_fit += len(report.calibration_records)
        self.rounds.extend(report.round_records)
        t = report.tree
        if t.drafting_steps > 0:  # steps that ran the drafter only: plain ones cost ~0 s
            self.draft_points.append((t.drafting_batch, t.drafting_nodes, t.drafting_s))
            self.draft_node_s = fit_draft_cost(self.draft_points)
        self._refit()
        self.reassign()
        e = self.replicas[report.replica_id]
        e.sent_source = self.price_source
        return {
            "budget": e.budget.to_wire(),
            "allocate": not self.override_fixed,
            "priced_at": e.priced_at,
            "registered": registered,
            "calibration": self.calibration if self.online_calibration else None,
        }

    def report_ingress(self, ingress_id: str, samples: list) -> None:
        """An API replica's latest counter samples (each report replaces its previous one)."""
        self.ingress_samples[ingress_id] = [(n, tuple(tuple(x) for x in lab), float(v)) for n, lab, v in samples]

    def prune(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        gone = expired({k: e.last_seen for k, e in self.replicas.items()}, now, self.heartbeat_timeout_s)
        for rid in gone:
            for k in COUNTERS:
                self.departed[k] += self.replicas[rid].report.counters.get(k, 0.0)
            self.departed_samples = merge(self.departed_samples, self.replicas[rid].report.metrics)
            del self.replicas[rid]
        self.dropped += len(gone)
        if gone:
            self.reassign()
        return gone

    def load(self) -> LoadSnapshot:
        return aggregate_load((e.report for e in self.replicas.values()), self.rounds.stats(), self.draft_node_s,
                              queue_growth(self.queue_history))

    def set_override(self, budget: Budget | None, fixed: bool = False) -> None:
        self.override, self.override_fixed = budget, budget is not None and fixed
        self.reassign()

    @property
    def price_source(self) -> str:
        return "cluster" if self.cluster_pricing else "local"

    def set_pricing(self, cluster: bool) -> None:
        """Price every replica on the cluster's load (``True``) or each on its own (``False``)."""
        self.cluster_pricing = cluster
        self.reassign()

    def reassign(self) -> None:
        """Ask the policy again for every replica's budget (after a load, policy, pricing or
        override change)."""
        loads = replica_loads(self.load(), {rid: e.report for rid, e in self.replicas.items()}, self.cluster_pricing)
        budgets = assign_budgets(self.policy, loads, self.override)
        for rid, b in budgets.items():
            e = self.replicas[rid]
            if b != e.budget:
                e.budget, e.version, e.priced_at = b, e.version + 1, time.time()

    def base_calibration(self) -> tuple[float, float]:
        """The stored calibration the replicas started from ((1, 0) if none reported)."""
        for e in self.replicas.values():
            if e.report.base_calibration is not None:
                return e.report.base_calibration
        return (1.0, 0.0)

    def _refit(self) -> None:
        """Refit (a, b) on the pooled records, with guards: none before
        ``min_calibration_records``; if the newest quarter's acceptance has drifted from
        the pool's by more than ``drift_tolerance``, the pool is cut to the newest (the
        drafter or the traffic changed); a fit that calibrates the records no better than
        the stored map is not pushed (the pushed map is the fit shrunk toward the stored one
        by ``calibration_prior_records``)."""
        if not (self.online_calibration and len(self.records) >= self.min_calibration_records
                and self._records_since_fit >= self.min_calibration_records // 4):
            return
        recent = list(self.records)[-5000:]  # keeps a refit well under a heartbeat
        newest = recent[-max(len(recent) // 4, 1):]
        pooled_rate = sum(r[1] for r in recent) / len(recent)
        newest_rate = sum(r[1] for r in newest) / len(newest)
        noise = 3.0 * math.sqrt(max(pooled_rate * (1 - pooled_rate), 1e-6) / len(newest))
        drift = abs(newest_rate - pooled_rate) > max(self.drift_tolerance, noise)
        if drift:
            self.records = deque(newest, maxlen=self.records.maxlen)
            recent = newest
        base = self.base_calibration()
        fit = fit_ab(recent)
        pushed = shrink_calibration(fit, base, len(self.records), self.calibration_prior_records)
        ece_stored, ece_fit = ece_on_records(recent, *base), ece_on_records(recent, *fit)
        self._records_since_fit = 0
        self.calibration_report = {"records": len(recent), "ece_stored": ece_stored,
                                   "ece_pushed": ece_on_records(recent, *pushed), "ece_fit": ece_fit,
                                   "a": pushed[0], "b": pushed[1], "drift": drift}
        if ece_fit > ece_stored:
            self.calibration_guard = "no better than the stored map"
            return
        self.calibration_guard = ""
        self.calibration = pushed

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
        acc = [r[1] for r in self.records]
        return {
            "replicas": {
                rid: {
                    "budget": e.budget.to_wire(),
                    "applied_budget": e.report.budget,
                    "budget_source": e.report.budget_source,
                    "price_source": e.applied_source,
                    "active": e.report.active,
                    "queued": e.report.queued,
                    "kv_cache_usage": e.report.kv_cache_usage,
                    "rss_bytes": e.report.rss_bytes,
                    "tokens_per_s": e.report.tokens_per_s,
                    "last_seen_s": now - e.last_seen,
                    "registered_s": now - e.registered_at,
                    "calibration": e.report.calibration,
                    "node_id": e.report.node_id,
                    "first_budget_s": e.report.first_budget_s,
                    "step_costs": e.report.step_costs,
                    "price_latency_s": e.report.price_latency_s,
                    "policy_share": e.report.policy_share,
                    "cost_factors": e.report.cost_factors,
                    **cost_view(e.report.cost_cells),
                    **asdict(e.report.tree),
                }
                for rid, e in sorted(self.replicas.items())
            },
            "cluster": asdict(self.load()),
            "override": self.override.to_wire() if self.override else None,
            "override_fixed": self.override_fixed,
            "price_source": self.price_source,
            "calibration": {
                "records": len(acc),
                "acceptance_rate": sum(acc) / len(acc) if acc else None,
                "online": self.online_calibration,
                "fitted": self.calibration,
                "report": self.calibration_report,
                "guard": self.calibration_guard,
            },
            "acceptance": self._acceptance_status(),
            "draft_node_s": self.draft_node_s,
            "queue_growth": queue_growth(self.queue_history),
            "registrations": self.registrations,
            "dropped": self.dropped,
            "uptime_s": time.time() - self.started_at,
            "counters": self.counters(),
        }

    def metrics_view(self) -> dict[str, Any]:
        """``status()`` and the cluster's Prometheus samples: every live replica's latest
        plus the dropped replicas' totals and the API replicas', summed
        (``deployments.metrics.render``)."""
        st = self.status()
        st["samples"] = merge(self.departed_samples, *(e.report.metrics for e in self.replicas.values()),
                              *self.ingress_samples.values())
        return st


def cost_view(cells: tuple[CostCell, ...]) -> dict[str, Any]:
    """A replica's online step-cost correction as its status shows it: the cells (rows,
    verified-node bin, steps, and mean step seconds on the startup table, on the corrected
    one, and measured) and how far the served costs are from the startup table
    (``cost_correction``: corrected / startup; ``step_time_over_table``: measured / startup;
    None without ``online_costs``)."""
    ratios = served_ratios(list(cells))
    return {"cost_cells": [asdict(c) for c in cells],
            "cost_correction": None if ratios is None else ratios[0],
            "step_time_over_table": None if ratios is None else ratios[1]}

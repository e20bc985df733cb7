"""A replica's heartbeat: reporting to the controller and applying its answer.

A thread reports load and tree statistics to the controller every ``heartbeat_s``
(``make_report``: the engine steps since the last beat summarized by
``summarize_steps``, the counters, calibration and per-round records) and applies the
budget and calibration in the reply. If the controller cannot be reached, the replica
prices its own speculation with the local policy from its own load, and keeps trying
(re-creating the controller if it is gone for good); the controller registers it again
on the first report that gets through.

``Heartbeat`` is this half of a replica, composed into ``ReplicaCore``: it is handed
the engine loop, the bundle, the replica's ``ReplicaCounters`` (shared with request
handling, which counts into them) and its ``ReplicaMetrics``, whose snapshot rides on
every report.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from deployments.config import AppArgs
from deployments.replica.engine_factory import EngineBundle
from deployments.replica.engine_loop import EngineLoop
from deployments.reports import TreeStats
from treespark.pricing.policy import BudgetPolicy, LoadSnapshot
from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration, logit
from treespark.spec.params import StepStats

log = logging.getLogger(__name__)


def ran_drafter(s: StepStats) -> bool:
    """Whether a step ran the drafter: some row had a node cap."""
    return any(c > 0 for c in s.node_caps)


def summarize_steps(stats: list[StepStats]) -> TreeStats:
    """Means of the engine's ``StepStats`` over one heartbeat window, and of the steps
    in it that ran the drafter."""
    if not stats:
        return TreeStats()
    n = len(stats)
    rows = [x for s in stats for x in range(s.batch_size)]
    nrows = max(len(rows), 1)
    drafting = [s for s in stats if ran_drafter(s)]
    nd = max(len(drafting), 1)

    def mean_rows(attr: str) -> float:
        return sum(sum(getattr(s, attr)) for s in stats) / nrows

    return TreeStats(
        steps=n,
        batch_size=sum(s.batch_size for s in stats) / n,
        mean_tree_size=mean_rows("tree_sizes"),
        mean_width=mean_rows("widths"),
        mean_depth=mean_rows("depths"),
        accepted_per_round=mean_rows("accepted"),
        step_s=sum(s.step_s for s in stats) / n,
        draft_s=sum(s.draft_s for s in stats) / n,
        verify_s=sum(s.verify_s for s in stats) / n,
        theta=stats[-1].theta,
        drafting_steps=len(drafting),
        drafting_batch=sum(s.batch_size for s in drafting) / nd,
        drafting_nodes=sum(sum(s.tree_sizes) for s in drafting) / nd,
        drafting_s=sum(s.draft_s for s in drafting) / nd,
    )


def round_records(s: StepStats) -> list[tuple[int, int]]:
    """(node cap, accepted) per row of one step: what the controller learns acceptance
    per tree size from. Keyed by the row's budget cap, the ``n`` a plan chooses, not by
    the tree drawn under it (a theta-priced tree is often smaller; an empty one accepts
    nothing whatever its neighbours drew)."""
    return [(int(n), int(a)) for n, a in zip(s.node_caps, s.accepted, strict=True)]


def calibration_records(records: list[tuple[float, bool, int]], cal: Calibration) -> list[tuple[float, bool, float]]:
    """(q, accepted, sibling rank) engine records as they travel: (logit q, accepted,
    offset). The controller fits sigmoid(a * logit q + b + offset), the map ``cal``
    applies, the offset being ``cal``'s fixed term for the edge's sibling rank."""
    xs = logit([q for q, _, _ in records]) if records else ()
    return [(float(x), bool(y), cal.offset(int(r))) for x, (_, y, r) in zip(xs, records, strict=True)]


def rss_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ReplicaCounters:
    """The replica's counters (``deployments.reports.COUNTERS``) and the tokens emitted
    since the last report, under one lock: request handling adds, the heartbeat reads."""

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(names, 0.0)
        self._emitted = 0

    def add(self, **increments: float) -> None:
        with self._lock:
            for name, n in increments.items():
                self._counts[name] += n

    def emitted(self, tokens: int) -> None:
        """``tokens`` new tokens went to a client (counted as ``generation_tokens`` too)."""
        with self._lock:
            self._counts["generation_tokens"] += tokens
            self._emitted += tokens

    def take_emitted(self) -> int:
        """The tokens emitted since the last call."""
        with self._lock:
            n, self._emitted = self._emitted, 0
            return n

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, name: str) -> float:
        with self._lock:
            return self._counts[name]


class Heartbeat:
    """A replica's link to the controller: its reports, and the budget and calibration
    it applies (``connect``: returns a controller handle; None: no thread, the replica
    prices itself with ``policy``, its local policy)."""

    def __init__(self, *, args: AppArgs, replica_id: str, node_id: str | None, policy: BudgetPolicy,
                 loop: EngineLoop, bundle: EngineBundle, counters: ReplicaCounters, metrics: Any,
                 connect: Callable[[], Any] | None) -> None:
        self.args = args
        self.replica_id = replica_id
        self.node_id = node_id              # the Ray node (None outside Ray), reported as is
        self.policy = policy
        self.loop = loop
        self.bundle = bundle                # its engine holds the stored ``Calibration``
        self.counters = counters
        self.metrics = metrics              # the replica's ``ReplicaMetrics``
        self.budget: Budget = self.policy.budget_for(LoadSnapshot.idle(), self.replica_id)
        self.budget_source = "local"
        self.loop.set_budget(self.budget)
        # False while the controller pins a fixed override: the replica then reports no
        # calibration records, since the refit is of the map its own allocation drafts with, and a
        # two-scalar map fitted to other trees' edges misfits its own (pooled with a comparison's
        # 32-node screens, the refit drafted 0.36 nodes a step at one row where the stored map drafted 2.6)
        self.allocating = True
        self.calibration: tuple[float, float] | None = None
        # the stored map: its sibling offsets stay fixed, the controller refits (a, b) around them
        self.stored_calibration: Calibration = self.bundle.engine.calibration
        # the refit is of the T = 0 map; sampled rows' records describe it only when
        # the same map also serves T > 0 (no sampled map of its own)
        self._refit_sampled = self.stored_calibration.sampled is None
        self.base_calibration = (float(self.stored_calibration.a), float(self.stored_calibration.b))
        self.controller_ok = False
        self.registrations = 0
        self.heartbeats_ok = 0
        self.heartbeats_failed = 0
        self.last_heartbeat_error: str | None = None
        self.last_tree = TreeStats()
        self._hb_started = time.monotonic()
        self.first_budget_s: float | None = None   # until the first budget from a controller
        self.price_latency: deque[float] = deque(maxlen=64)
        self._connect = connect
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, name="treespark-heartbeat", daemon=True)
        if connect is not None:
            self._hb.start()

    @property
    def alive(self) -> bool:
        return self._hb.is_alive()

    def status(self) -> dict[str, Any]:
        """The heartbeat's part of the replica's status."""
        return {
            "budget": self.budget.to_wire(),
            "budget_source": self.budget_source,
            "controller_ok": self.controller_ok,
            "registrations": self.registrations,
            "node_id": self.node_id,
            "first_budget_s": self.first_budget_s,
            "heartbeats_ok": self.heartbeats_ok,
            "heartbeats_failed": self.heartbeats_failed,
            "last_heartbeat_error": self.last_heartbeat_error,
            "heartbeat_alive": self.alive,
            "tree": self.last_tree.__dict__,
        }

    def stop(self) -> None:
        self._stop.set()

    def make_report(self, dt: float) -> dict[str, Any]:
        window = [s for _, s in self.loop.drain_step_stats()]
        tree = summarize_steps(window)
        if window:
            self.last_tree = tree
        else:  # idle: keep showing the last trees, marked as no steps in this window
            tree = dataclasses.replace(self.last_tree, steps=0)
        records: list[tuple[float, bool, float]] = []
        rounds: list[tuple[int, int]] = []
        for s in window:
            self.counters.add(steps=1, rounds=s.batch_size, draft_tokens=sum(s.tree_sizes),
                              accepted_tokens=sum(s.accepted))
            if self.allocating:   # (a pinned fixed override's trees are not what this replica serves)
                used = s.calibration_records + (s.sampled_records if self._refit_sampled else ())
                records.extend(calibration_records(list(used), self.stored_calibration))
            rounds.extend(round_records(s))
        emitted = self.counters.take_emitted()
        counters = self.counters.snapshot()
        self.metrics.steps(window)
        load = self.loop.load
        self.metrics.engine_counts(load.prefix_cache_queries, load.prefix_cache_hits, load.preemptions)
        return {
            "replica_id": self.replica_id,
            "active": load.running,
            "queued": load.waiting,
            "kv_cache_usage": load.kv_usage,
            "rss_bytes": rss_bytes(),
            "tokens_per_s": emitted / dt if dt > 0 else 0.0,
            "tree": tree.__dict__,
            "budget": self.budget.to_wire(),
            "budget_source": self.budget_source,
            "counters": counters,
            "calibration_records": records[-1024:],
            "calibration": self.calibration,
            "round_records": rounds[-2048:],
            "base_calibration": self.base_calibration,
            "metrics": self.metrics.snapshot(),
            "node_id": self.node_id,
            "first_budget_s": self.first_budget_s,
            "step_costs": self.bundle.step_costs,
            "price_latency_s": list(self.price_latency),
            "cost_factors": self._cost_factors(),
            "cost_cells": self._cost_cells(),
            "policy_share": (sum(getattr(s, "policy_s", 0.0) for s in window) / max(sum(s.step_s for s in window), 1e-9)
                             if window else 0.0),
        }

    def _fit(self):
        """The engine's online correction of its step-cost table (perstep with
        ``online_costs``), or None."""
        return getattr(getattr(self.bundle.engine, "allocator", None), "fit", None)

    def _cost_factors(self) -> list[float] | None:
        """[draft, base, extra] as applied to the table (guarded), or None."""
        fit = self._fit()
        if fit is None:
            return None
        f = fit.factors()
        return [f.draft, f.base, f.extra]

    def _cost_cells(self) -> list[list[float]]:
        """Per (rows, verified-node bin): [rows, nodes, steps, startup table s, corrected s,
        measured s], the decayed mean step seconds (``CostFit.cells``); none without a fit."""
        fit = self._fit()
        return [] if fit is None else [[c.rows, c.nodes, c.steps, c.table_s, c.corrected_s, c.measured_s]
                                       for c in fit.cells()]

    def apply_budget(self, budget: Budget, source: str) -> None:
        self.budget_source = source
        if budget != self.budget:
            self.budget = budget
            self.loop.set_budget(budget)

    def apply_allocating(self, on: bool) -> None:
        if on != self.allocating:
            self.allocating = on
            self.loop.set_allocating(on)

    def heartbeat_once(self, handle: Any, dt: float) -> dict[str, Any]:
        """One report; raises if the controller does not answer in time."""
        import ray

        report = self.make_report(dt)
        reply = ray.get(handle.report.remote(report), timeout=self.args.controller.rpc_timeout_s)
        if reply.get("registered"):
            self.registrations += 1
        if not self.args.controller.pricing:  # the controller observes; this replica prices itself
            self._use_local_policy()
            return reply
        budget = Budget.from_wire(reply["budget"])
        if budget != self.budget and reply.get("priced_at"):
            self.price_latency.append(max(time.time() - float(reply["priced_at"]), 0.0))
        self.apply_budget(budget, "controller")
        self.apply_allocating(bool(reply.get("allocate", True)))
        if self.first_budget_s is None:
            self.first_budget_s = time.monotonic() - self._hb_started
        cal = reply.get("calibration")
        if cal is not None and tuple(cal) != self.calibration:
            self.calibration = (float(cal[0]), float(cal[1]))
            self.loop.set_calibration(*self.calibration)
        return reply

    def _heartbeat_loop(self) -> None:
        period = self.args.controller.heartbeat_s
        handle, last, retry_at = None, time.monotonic(), 0.0
        wait = 0.0  # the first report at once: a new replica registers and gets its budget now
        while not self._stop.wait(wait):
            wait = period
            now = time.monotonic()
            if handle is None and now < retry_at:  # controller down: back off a little
                self._use_local_policy()
                continue
            try:
                if handle is None:
                    handle = self._connect()
                self.heartbeat_once(handle, now - last)
                self.controller_ok = True
                self.heartbeats_ok += 1
            except Exception as err:  # noqa: BLE001 - controller unreachable: serve on
                self.heartbeats_failed += 1
                self.last_heartbeat_error = repr(err)[:500]
                if self.controller_ok:
                    log.warning("replica %s: controller unreachable (%r); using the local policy", self.replica_id, err)
                self.controller_ok = False
                handle, retry_at = None, time.monotonic() + 0.5
                self._use_local_policy()
            last = now

    def _use_local_policy(self) -> None:
        self.apply_allocating(True)
        load = self.loop.load
        self.apply_budget(self.policy.budget_for(LoadSnapshot(1, load.running, load.waiting), self.replica_id), "local")

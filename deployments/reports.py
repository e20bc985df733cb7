"""What a replica and the controller say to each other on every heartbeat.

A replica sends a ``ReplicaReport`` (as a plain dict: it crosses Ray) with its load,
the ``TreeStats`` of its recent engine steps, its cumulative ``COUNTERS`` and the
records the controller learns from; the reply carries a budget in the same wire form
(``Budget.to_wire`` / ``Budget.from_wire``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from treespark.pricing.costfit import CostCell

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
    # the steps that ran the drafter (some row had a node cap), alone: what the controller
    # fits the drafting cost on (a window's means mix them with plain steps, ~0 s each)
    drafting_steps: int = 0
    drafting_batch: float = 0.0   # rows per drafting step
    drafting_nodes: float = 0.0   # draft nodes per drafting step, all rows together
    drafting_s: float = 0.0       # draft seconds per drafting step


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
    # (logit q, accepted, logit offset of the edge's sibling rank under the stored calibration)
    calibration_records: tuple[tuple[float, bool, float], ...] = ()
    calibration: tuple[float, float] | None = None
    round_records: tuple[tuple[int, int], ...] = ()         # (node cap, accepted) per request-round
    base_calibration: tuple[float, float] | None = None     # the replica's stored (a, b)
    kv_cache_usage: float | None = None                     # fraction of the engine's KV blocks held
    rss_bytes: int | None = None                            # the replica process's resident memory
    metrics: tuple = ()     # the replica's Prometheus samples (deployments.metrics.ReplicaMetrics.snapshot)
    node_id: str | None = None                              # the Ray node the replica runs on
    first_budget_s: float | None = None                     # heartbeat start -> first budget from a controller
    step_costs: dict[str, Any] | None = None   # the replica's startup step-cost table (perstep), summarized
    price_latency_s: tuple[float, ...] = ()    # controller price change -> applied here, recent ones
    policy_share: float = 0.0                  # the per-step allocation's CPU seconds over step seconds
    cost_factors: tuple[float, float, float] | None = None   # (draft, base, extra): the online fit on the table
    cost_cells: tuple[CostCell, ...] = ()   # the online fit's mean step seconds by (rows, verified-node bin)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ReplicaReport:
        """The report from its wire dict (what ``Heartbeat.make_report`` sends: every
        field, JSON-shaped)."""

        def pair(v: Any) -> tuple[float, float] | None:
            return None if v is None else (float(v[0]), float(v[1]))

        return cls(**{
            **d,
            "tree": TreeStats(**d["tree"]),
            "calibration_records": tuple((float(x), bool(y), float(o)) for x, y, o in d["calibration_records"]),
            "calibration": pair(d["calibration"]),
            "round_records": tuple((int(n), int(a)) for n, a in d["round_records"]),
            "base_calibration": pair(d["base_calibration"]),
            "price_latency_s": tuple(float(x) for x in d.get("price_latency_s", ())),
            "cost_factors": None if d.get("cost_factors") is None else tuple(float(x) for x in d["cost_factors"]),
            "cost_cells": tuple(CostCell(int(c[0]), int(c[1]), *(float(x) for x in c[2:])) for c in d.get("cost_cells", ())),
        })

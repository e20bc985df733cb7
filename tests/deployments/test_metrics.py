"""Prometheus metrics (``deployments.metrics``): a replica's registry, the controller's
merge of replicas (monotone across a dropped replica), and ``/metrics`` in-process over
the fake engine, parsed with ``prometheus_client``'s own parser."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving.fake_engine import StepStats
from serving.policies import LADDER

from deployments.config import AppArgs
from deployments.controller.state import ControllerState
from deployments.metrics import ReplicaMetrics, budget_mode, merge, render
from deployments.reports import ReplicaReport, TreeStats
from treespark.pricing.costfit import CostCell
from treespark.pricing.policy import LadderPolicy

MODEL = "treespark-random"


def parse(text: str | bytes) -> dict[str, list]:
    """sample name -> [(labels, value)]"""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples, name, **labels):
    hits = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def step(tree_sizes, accepted):
    n = len(tree_sizes)
    return StepStats(n, n, tuple(tree_sizes), (1,) * n, (1,) * n, tuple(accepted), 0.1, 0.0, 0.0, 0.01, ())


def snap(m: ReplicaMetrics) -> dict:
    return {(name, labels): v for name, labels, v in m.snapshot()}


def test_steps_count_drafts_and_positions():
    m = ReplicaMetrics()
    m.steps([step([4, 0, 3], [2, 0, 3]), step([0], [0])])
    s = snap(m)
    assert s[("treespark:engine_steps_total", ())] == 2
    assert s[("treespark:spec_decode_num_drafts_total", ())] == 2          # empty trees are not drafts
    assert s[("treespark:spec_decode_num_draft_tokens_total", ())] == 7
    assert s[("treespark:spec_decode_num_accepted_tokens_total", ())] == 5
    per_pos = {dict(lab)["position"]: v for (n, lab), v in s.items() if n.endswith("per_pos_total")}
    assert per_pos == {"0": 2, "1": 2, "2": 1}


def test_request_clock():
    m = ReplicaMetrics()
    c = m.request()
    c.scheduled()
    c.emitted(1)
    c.emitted(3)
    c.finished("length", prompt_tokens=5)
    m.request().aborted(prompt_tokens=2)
    s = snap(m)
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_time_per_output_token_seconds"):
        assert s[(f"treespark:{h}_count", ())] == 1, h
    assert s[("treespark:generation_tokens_total", ())] == 4
    assert s[("treespark:prompt_tokens_total", ())] == 7
    assert s[("treespark:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("treespark:request_aborted_total", ())] == 1


def test_engine_counts_add_what_the_engine_counters_grew():
    """The heartbeat hands the engine's cumulative counters over each time; the replica's
    counters grow by the difference, so they equal the engine's."""
    m = ReplicaMetrics()
    m.engine_counts(100, 32, 0)
    m.engine_counts(100, 32, 0)    # an idle beat adds nothing
    m.engine_counts(250, 96, 2)
    s = snap(m)
    assert s[("treespark:prefix_cache_queries_total", ())] == 250
    assert s[("treespark:prefix_cache_hits_total", ())] == 96
    assert s[("treespark:num_preemptions_total", ())] == 2


def report(rid, metrics, budget=None, kv=None):
    return ReplicaReport(rid, 1, 2, 10.0, TreeStats(steps=1), budget or {"theta": 0.1, "node_cap": 4, "branch_cap": 1},
                         "controller", {}, metrics=tuple(metrics), kv_cache_usage=kv)


def test_cluster_totals_stay_monotone_when_a_replica_is_dropped():
    t = [0.0]
    s = ControllerState(LadderPolicy(), heartbeat_timeout_s=2.0, clock=lambda: t[0])
    a, b = ReplicaMetrics(), ReplicaMetrics()
    a.steps([step([4], [2])])
    b.steps([step([3, 3], [1, 3])])
    for m in (a, b):
        c = m.request()
        c.emitted(2)
        c.finished("stop", 3)
    s.report(report("a", a.snapshot()))
    s.report(report("b", b.snapshot()))

    def totals():
        return parse(render(s.metrics_view(), MODEL))

    before = totals()
    assert value(before, "treespark:spec_decode_num_draft_tokens_total") == 10
    assert value(before, "treespark:time_to_first_token_seconds_count") == 2
    t[0] = 1.5
    s.report(report("a", a.snapshot()))
    t[0] = 3.0  # b silent for 3 s: dropped
    s.report(report("a", a.snapshot()))
    after = totals()
    assert value(after, "treespark:num_replicas") == 1
    for name in ("treespark:spec_decode_num_draft_tokens_total", "treespark:time_to_first_token_seconds_count",
                 "treespark:spec_decode_num_accepted_tokens_total"):
        assert value(after, name) == value(before, name), name
    assert value(after, "treespark:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    assert value(after, "treespark:request_success_total", finished_reason="stop") == 2


def test_merge_sums_histograms():
    a, b = ReplicaMetrics(), ReplicaMetrics()
    for m, dt in ((a, 0.0), (b, 0.0)):
        m.request().emitted(1 + int(dt))
    merged = {(n, lab): v for n, lab, v in merge(a.snapshot(), b.snapshot())}
    assert merged[("treespark:time_to_first_token_seconds_count", ())] == 2
    assert merged[("treespark:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2


def test_budget_mode():
    assert budget_mode({"node_cap": 0, "branch_cap": 4}) == "plain"
    assert budget_mode({"node_cap": 4, "branch_cap": 1}) == "chain"
    assert budget_mode({"node_cap": 16, "branch_cap": 2}) == "tree"


def test_render_per_replica_gauges():
    s = ControllerState(LadderPolicy())
    s.report(report("r1", (), budget={"theta": 0.25, "node_cap": 4, "branch_cap": 1}, kv=0.375))
    s.report(report("r2", ()))   # an engine without a KV cache
    text = render(s.metrics_view(), MODEL)
    m = parse(text)
    assert value(m, "treespark:spec_decode_theta", replica="r1") == 0.25
    assert value(m, "treespark:spec_decode_mode", replica="r1", mode="chain") == 1
    assert value(m, "treespark:spec_decode_mode", replica="r1", mode="tree") == 0
    assert value(m, "treespark:kv_cache_usage_perc", replica="r1") == 0.375
    assert math.isnan(value(m, "treespark:kv_cache_usage_perc", replica="r2"))
    assert 0 <= value(m, "treespark:controller_broadcast_age_seconds", replica="r1") < 1
    assert value(m, "treespark:num_requests_waiting", replica="r1") == 2
    assert value(m, "treespark:request_aborted_total") == 0   # unlabelled counters read 0 before any event
    assert b"# TYPE treespark:time_to_first_token_seconds histogram" in text


def test_the_online_cost_correction_per_replica():
    """A replica's cost cells reach the controller's status and two gauges: the served
    (corrected) and the measured step seconds over the startup table's, step-weighted."""
    s = ControllerState(LadderPolicy())
    cells = (CostCell(1, 0, 10.0, 0.01, 0.015, 0.02), CostCell(4, 4, 30.0, 0.02, 0.03, 0.03))
    wire = {**asdict(report("r1", ())), "tree": asdict(TreeStats(steps=1)),
            "cost_cells": [[c.rows, c.nodes, c.steps, c.table_s, c.corrected_s, c.measured_s] for c in cells]}
    s.report(ReplicaReport.from_wire(wire))
    s.report(report("r2", ()))   # online_costs off
    r1 = s.status()["replicas"]["r1"]
    assert [CostCell(**c) for c in r1["cost_cells"]] == list(cells)
    assert r1["cost_correction"] == pytest.approx(1.05 / 0.7) and r1["step_time_over_table"] == pytest.approx(1.1 / 0.7)
    m = parse(render(s.metrics_view(), MODEL))
    assert value(m, "treespark:step_cost_correction", replica="r1") == pytest.approx(1.5)
    assert value(m, "treespark:step_time_over_table", replica="r1") == pytest.approx(1.1 / 0.7)
    assert math.isnan(value(m, "treespark:step_cost_correction", replica="r2"))


# -- /metrics in-process: the real routes, replica core and controller state -----------------------

@pytest.fixture(scope="module")
def local_api():
    from serving.inprocess import LocalApi

    a = LocalApi(AppArgs(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_batch_size=4,
                         max_context=256))
    yield a
    a.close()


def test_metrics_route_after_traffic(local_api):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 6}
    for extra in ({}, {"stream": True}, {"max_tokens": 1}):
        assert local_api.post("/v1/completions", {**body, **extra}).status == 200
    local_api.beat()
    r = local_api.get("/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse(r.body)
    assert value(m, "treespark:request_success_total", finished_reason="length") == 3
    assert value(m, "treespark:time_to_first_token_seconds_count") == 3
    assert value(m, "treespark:request_queue_time_seconds_count") == 3       # the fake engine reports scheduling
    assert value(m, "treespark:e2e_request_latency_seconds_count") == 3
    assert value(m, "treespark:inter_token_latency_seconds_count") >= 2      # the 1-token request has none
    assert value(m, "treespark:generation_tokens_total") == 13
    assert value(m, "treespark:spec_decode_num_drafts_total") > 0
    assert value(m, "treespark:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert value(m, "treespark:num_replicas") == 1
    (rid,) = {lab["replica"] for lab, _ in m["treespark:spec_decode_theta"]}
    assert rid == "local-0"
    assert sum(value(m, "treespark:spec_decode_mode", replica=rid, mode=x) for x in ("tree", "chain", "plain")) == 1
    assert all(not math.isnan(v) for _, v in m["treespark:time_to_first_token_seconds_bucket"])


def test_queue_time_from_the_real_engine():
    """The real engine reports scheduling (``Engine.on_schedule``): one queue-time sample per
    request, observed before its first token."""
    from serving.inprocess import LocalApi

    a = LocalApi(AppArgs(model="random", vocab_size=512, max_batch_size=2, max_context=128, policy=LADDER))
    try:
        for extra in ({}, {"stream": True}):
            assert a.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}).status == 200
        a.beat()
        m = parse(a.get("/metrics").body)
        assert value(m, "treespark:request_queue_time_seconds_count") == 2
        assert value(m, "treespark:request_queue_time_seconds_sum") <= value(m, "treespark:time_to_first_token_seconds_sum")
    finally:
        a.close()


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_and_kv_series_from_the_real_engine(caching):
    """The same prompt twice on the real engine (16-token blocks): both are looked up; with
    the prefix cache on, the second finds every full block but the one of its last token
    cached, with it off nothing. ``prefix_caching`` and ``max_num_batched_tokens`` in the
    app's args reach the engine."""
    from serving.inprocess import LocalApi

    a = LocalApi(AppArgs(model="random", vocab_size=512, max_batch_size=2, max_context=256, policy=LADDER,
                         prefix_caching=caching, max_num_batched_tokens=100 + caching))
    try:
        assert a.core.bundle.engine.kv.pool.caching is caching
        assert a.core.bundle.engine.sched.max_num_batched_tokens == 100 + caching
        body = {"model": MODEL, "prompt": "The shared system prompt of a chat, " * 3, "max_tokens": 4}
        sizes = []
        for _ in range(2):
            r = a.post("/v1/completions", body)
            assert r.status == 200
            sizes.append(r.json()["usage"]["prompt_tokens"])
        n = sizes[0]
        assert sizes == [n, n] and n > 32
        loop = a.core.loop
        deadline = time.monotonic() + 60   # a guard: the loop snapshots its load right after the last step
        while loop.load.running or loop.load.waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        a.beat()
        m = parse(a.get("/metrics").body)
        assert value(m, "treespark:prefix_cache_queries_total") == 2 * n
        assert value(m, "treespark:prefix_cache_hits_total") == ((n - 1) // 16 * 16 if caching else 0)
        assert value(m, "treespark:prompt_tokens_total") == 2 * n
        assert value(m, "treespark:num_preemptions_total") == 0
        assert value(m, "treespark:kv_cache_usage_perc", replica="local-0") == 0.0   # idle: no block held
    finally:
        a.close()


# -- the Grafana dashboard ----------------------------------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/treespark.json"


def dashboard_queries() -> list[str]:
    def walk(panels):
        for p in panels:
            yield from (t["expr"] for t in p.get("targets", ()))
            yield from walk(p.get("panels", ()))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def test_grafana_dashboard_queries_are_exported(local_api):
    """Every metric a panel queries is in /metrics (after traffic, so that labelled families
    have samples)."""
    assert local_api.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5}).status == 200
    local_api.beat()
    exported = set(parse(local_api.get("/metrics").body))
    queries = dashboard_queries()
    assert len(queries) >= 15
    used = {name for e in queries for name in re.findall(r"treespark:[A-Za-z0-9_:]+", e)}
    assert used and used <= exported, sorted(used - exported)
    # the must-haves are on the dashboard
    for name in ("time_to_first_token_seconds_bucket", "spec_decode_num_accepted_tokens_per_pos_total",
                 "spec_decode_theta", "spec_decode_mode", "controller_broadcast_age_seconds", "kv_cache_usage_perc",
                 "request_retries_total", "stream_resumes_total", "stream_failures_total",
                 "stream_resume_seconds_bucket", "replica_first_budget_seconds", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        assert "treespark:" + name in used, name


def test_grafana_dashboard_is_well_formed():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "model"}
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all('model_name=~"$model"' in t["expr"] for t in p["targets"]), p["title"]


def test_ingress_counters_of_several_api_replicas_add_up():
    """Each API replica's latest snapshot replaces its previous one; the API replicas' sum
    is in /metrics next to the engine replicas' counters."""
    from deployments.metrics import IngressMetrics

    st = ControllerState(LadderPolicy())
    a, b = IngressMetrics(), IngressMetrics()
    a.retried()
    st.report_ingress("api-a", a.snapshot())
    a.resumed(2.0)
    a.stream_failed("engine_error")
    st.report_ingress("api-a", a.snapshot())   # replaces the first
    b.retried()
    st.report_ingress("api-b", b.snapshot())
    m = parse(render(st.metrics_view(), MODEL))
    assert value(m, "treespark:request_retries_total") == 2
    assert value(m, "treespark:stream_resumes_total") == 1
    assert value(m, "treespark:stream_resume_seconds_sum") == 2.0
    assert value(m, "treespark:stream_failures_total", code="engine_error") == 1
    assert value(m, "treespark:stream_failures_total", code="replica_failed") == 0

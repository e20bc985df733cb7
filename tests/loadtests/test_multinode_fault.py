"""The multi-node fault experiment's report (``loadtests.multinode``), without a cluster: the
API's counters read from a real ``/metrics`` exposition, and ``fault_summary`` over a
synthetic run (status polls, per-request records) writes what it resumed and lost."""

import argparse
import json
import types

from deployments.metrics import IngressMetrics, render
from loadtests.common import read_records
from loadtests.multinode import (
    answer_check,
    fault_summary,
    ingress_counters,
    ingress_report,
    replica_rows,
)


def exposition(m: IngressMetrics) -> str:
    return render({"samples": m.snapshot(), "replicas": {}}, "treespark-random").decode()


def test_ingress_report_from_two_readings_of_metrics():
    m = IngressMetrics()
    before = ingress_counters(exposition(m))
    assert before["stream_resumes_total"] == 0 and before["stream_failures_total"] == 0
    for pause in (0.5, 1.5):
        m.retried()
        m.resumed(pause)
    m.retried()
    m.stream_failed("replica_failed")
    rep = ingress_report(before, ingress_counters(exposition(m)))
    assert rep == {"api_retries": 3, "streams_resumed": 2, "streams_failed": 1,
                   "streams_failed_by_code": {"replica_failed": 1}, "resumed_stream_added_latency_s": 1.0}
    assert ingress_report(before, before)["resumed_stream_added_latency_s"] is None


def test_fault_summary_reports_resumed_and_failed_streams(tmp_path):
    status = {"dropped": 0, "replicas": {
        rid: {"node_id": node, "budget": {"theta": 0.1, "node_cap": 4}, "budget_source": "controller", "active": 1,
              "queued": 0, "tokens_per_s": 50.0, "first_budget_s": 0.3, "last_seen_s": 0.1}
        for rid, node in (("a", "node-a"), ("b", "node-b"))}}
    rows = [r for t in range(0, 30) for r in replica_rows(status, t)]
    after = {**status, "replicas": {"b": status["replicas"]["b"]}}
    rows += [r for t in range(30, 40) for r in replica_rows(after, t)]
    t0 = 1000.0
    work = tmp_path / "work"
    work.mkdir()
    for kind in ("stream", "plain"):
        with (work / f"{kind}-records.jsonl").open("w") as f:
            for i in range(40):
                # prompt 3's streamed answer at t0 + 30 (after the kill) came out otherwise
                text = "wrong" if kind == "stream" and i == 30 else f"answer {i % 5}"
                f.write(json.dumps({"t0": t0 + i, "t1": t0 + i + 1.5, "ttft": 0.1, "tokens": 32, "ok": True,
                                    "status": 200, "prompt": i % 5, "seed": i, "text": text}) + "\n")
    poller = types.SimpleNamespace(rows=rows, t0=t0)
    a = argparse.Namespace(pair="random", temperature=0.0, users=2, duration=40, max_tokens=32, retries=2, out=tmp_path / "out")
    recs = {k: read_records(work / f"{k}-records.jsonl") for k in ("stream", "plain")}
    reference = {(i, -1): f"answer {i}" for i in range(5)}
    ingress = {"api_retries": 3, "streams_resumed": 2, "streams_failed": 0, "streams_failed_by_code": {},
               "resumed_stream_added_latency_s": 0.8}
    summary = fault_summary(a, poller, work, 29.5, 40.0, ["a"], "node-a", ingress, {"stream": 0, "plain": 0},
                            after, [], recs, reference)
    written = json.loads((a.out / "fault-summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["streams_resumed"] == 2 and written["streams_failed"] == 0
    assert written["resumed_stream_added_latency_s"] == 0.8 and written["api_retries"] == 3
    assert written["requests"]["stream"]["failed"] == 0 and not written["hung"]
    assert written["requests"]["stream"]["answer_check"] == {"checked": 40, "differ": 1, "differ_prompts": [0]}
    assert written["requests"]["plain"]["answer_check"] == {"checked": 40, "differ": 0, "differ_prompts": []}
    assert (a.out / "fault.png").stat().st_size > 0


def test_answer_check_keys_greedy_answers_by_prompt_and_sampled_ones_by_seed_too():
    recs = [{"ok": True, "prompt": 1, "seed": 3, "text": "x"}, {"ok": False, "prompt": 1, "seed": 4, "text": ""},
            {"ok": True, "prompt": -1, "seed": 5, "text": "Hello?"}, {"ok": True, "prompt": 2, "seed": 6, "text": "y"}]
    assert answer_check(recs, {(1, -1): "x", (2, -1): "z"}, 0.0) == {"checked": 2, "differ": 1, "differ_prompts": [2]}
    # sampled: the same prompt under another seed is another answer (no reference, not checked)
    assert answer_check(recs, {(1, 3): "x", (2, 7): "y"}, 1.0) == {"checked": 1, "differ": 0, "differ_prompts": []}
    assert answer_check(recs, {(1, 3): "w"}, 1.0)["differ"] == 1

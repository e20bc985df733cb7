"""Load-test pieces: shapes, the runner's timeline, the report; and a short real run
(Serve started by the runner, Locust on a ramp, the timeline CSV and PNG written)."""

import csv
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from loadtests.experiment import TIMELINE_FIELDS, finish_timeline, main, speculation_row, write_csv
from loadtests.report import (
    compare_detail,
    compare_table,
    plot_compare,
    plot_timeline,
    ramp_levels,
    ramp_summary,
    read_rows,
    tie_ratio,
)
from loadtests.shapes import Stage, parse_shape, step_ramp, total_duration, users_at


def test_shapes():
    ramp = parse_shape("ramp:1,4,16:10")
    assert [s.users for s in ramp] == [1, 4, 16, 4, 1] and total_duration(ramp) == 50
    assert parse_shape("up:1,4:5") == step_ramp((1, 4), 5, down=False)
    assert [s.users for s in parse_shape("spike:2,16:10,5,10")] == [2, 16, 2]
    assert parse_shape("const:8:60") == (Stage(60, 8),)
    assert users_at(ramp, 0) == 1 and users_at(ramp, 25) == 16 and users_at(ramp, 49.9) == 1
    assert users_at(ramp, 50) is None
    for bad in ("ramp:1,2", "wave:1:2", "const:x:1", "spike:1:2,3"):
        with pytest.raises(ValueError):
            parse_shape(bad)


STATUS = {
    "replicas": {
        "a": {"applied_budget": {"theta": 0.1, "node_cap": 8, "branch_cap": 2}, "active": 3, "queued": 3,
              "batch_size": 3.0, "mean_tree_size": 6.0, "mean_width": 2.0, "mean_depth": 3.0,
              "accepted_per_round": 1.0, "step_s": 0.2},
        "b": {"applied_budget": {"theta": 0.3, "node_cap": 2, "branch_cap": 1}, "active": 1, "queued": 1,
              "batch_size": 1.0, "mean_tree_size": 2.0, "mean_width": 1.0, "mean_depth": 2.0,
              "accepted_per_round": 0.5, "step_s": 0.1},
    },
    "counters": {"generation_tokens": 100.0},
    "calibration": {"report": {"ece_stored": 0.2, "ece_pushed": 0.05}},
}


def test_speculation_row_weights_replicas_by_batch():
    row = speculation_row(STATUS)
    assert row["replicas"] == 2 and row["active"] == 4
    assert row["queued"] == 4 and row["queued_max"] == 3   # the cluster's queue, and the most on one replica
    assert row["theta"] == pytest.approx(0.15) and row["tree_size"] == pytest.approx(5.0)
    assert row["calib_ece_pushed"] == 0.05
    assert row["cost_base"] == ""                           # no replica reports an online fit
    fitted = {**STATUS, "replicas": {k: {**r, "cost_factors": f} for (k, r), f in
                                     zip(STATUS["replicas"].items(), ([1.0, 2.0, 3.0], [2.0, 2.0, 1.0]), strict=True)}}
    row = speculation_row(fitted)
    assert (row["cost_draft"], row["cost_base"], row["cost_extra"]) == pytest.approx((1.25, 2.0, 2.5))


def test_timeline_goodput_latency_and_report(tmp_path):
    rows, recs = [], []
    for t in range(60):
        users = 1 if t < 20 else (8 if t < 40 else 1)
        rows.append({"t": t, "wall": 1000.0 + t, **speculation_row(STATUS), "generation_tokens": 10.0 * t,
                     "tree_size": 12.0 if users == 1 else 3.0, "batch_size": float(users)})
        recs.append({"t0": 999.5 + t, "t1": 1000.0 + t, "ttft": 0.1, "tokens": 10, "ok": True})
    out = finish_timeline(rows, recs, [(1000.0 + t, 1 if t < 20 else (8 if t < 40 else 1)) for t in range(60)],
                          (), 1000.0)
    assert out[10]["goodput_tok_s"] == pytest.approx(10.0)
    assert out[10]["p50_e2e_s"] == pytest.approx(0.5) and out[10]["requests_done"] == 11
    path = tmp_path / "timeline.csv"
    write_csv(path, out, TIMELINE_FIELDS)
    levels = ramp_levels(read_rows(path))
    assert [(lv["phase"], lv["users"]) for lv in levels] == [("up", 1), ("peak", 8), ("down", 1)]
    summary = ramp_summary(path)
    assert "ratio 4.0x" in summary
    plot_timeline(path, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_compare_table(tmp_path):
    path = tmp_path / "compare.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["policy", "run", "users", "goodput_tok_s", "tree_size"])
        w.writeheader()
        for p, g in (("perstep", [[10, 11, 12], [30, 30, 30]]), ("ladder", [[9, 9, 9], [28, 28, 28]]),
                     ("off", [[6, 5, 7], [29, 31, 30]])):
            for u, xs in zip((1, 16), g, strict=True):
                for run, x in enumerate(xs, 1):
                    w.writerow({"policy": p, "run": run, "users": u, "goodput_tok_s": x, "tree_size": 1})
    table = compare_table(path)
    # medians of three runs, +- half their spread; ratios to the best other, the ladder; minus off (its spread)
    assert "| 1 | 11.0 ±1.0 (tree 1.0) | 9.0 ±0.0 (tree 1.0) | 6.0 ±1.0 (tree 1.0) | 1.22 | 1.22 | +5.0 (2.0) |" in table
    assert "| 16 | 30.0 ±0.0 (tree 1.0) | 28.0 ±0.0 (tree 1.0) | 30.0 ±1.0 (tree 1.0) | 1.00 | 1.07 | +0.0 (2.0) |" in table
    assert "geometric mean over the levels: 1.106; lowest 1.000 (medians of 3 run(s) per cell)" in table
    plot_compare(path, tmp_path / "compare.png")


def test_compare_detail_gives_every_run_and_the_queue(tmp_path):
    path = tmp_path / "compare.csv"
    fields = ["policy", "run", "users", "goodput_tok_s", "tree_size", "theta", "queued", "queued_max",
              "p50_ttft_s", "p50_e2e_s", "p99_e2e_s"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for run, (g, q) in enumerate(((12, 2.0), (10, 6.0), (11, 4.0)), 1):
            w.writerow({"policy": "perstep", "run": run, "users": 16, "goodput_tok_s": g, "tree_size": 0.5,
                        "theta": 0.3, "queued": q, "queued_max": 2 * q, "p50_ttft_s": 1.5,
                        "p50_e2e_s": 3, "p99_e2e_s": 4})
    detail = compare_detail(path)
    # the median run's row (goodput 11: its queue 4.0, at most 8 on one replica), every run listed
    assert "| 16 | perstep | 11.0 (10.0, 11.0, 12.0) | 0.5 | 0.30 | 4.0 (8) | 1.50 | 3.00 | 4.00 |" in detail


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_short_locust_run_against_the_service(tmp_path):
    """`python -m loadtests.experiment ramp` end to end on the random pair (~70 s)."""
    main(["ramp", "--config", "configs/load-random.yaml", "--port", str(_free_port()),
          "--shape", "ramp:1,4:10", "--max-tokens", "16", "--out", str(tmp_path), "--ready-timeout", "120"])
    rows = read_rows(tmp_path / "timeline.csv")
    assert len(rows) >= 20 and list(rows[0]) == TIMELINE_FIELDS
    assert max(int(r["users"]) for r in rows) == 4
    assert any(float(r["goodput_tok_s"] or 0) > 0 for r in rows)
    assert all(r["theta"] != "" for r in rows)
    assert int(rows[-1]["requests_done"]) > 5
    recs = [json.loads(x) for x in (tmp_path / "raw" / "timeline-records.jsonl").read_text().splitlines()]
    assert recs and all(r["ok"] and r["tokens"] == 16 and r["ttft"] is not None for r in recs)
    assert (tmp_path / "timeline.png").exists() and (tmp_path / "timeline-summary.md").exists()


def test_a_service_started_by_a_runner_that_ignores_sigint_still_stops_on_sigint(tmp_path):
    """A runner started in the background ignores SIGINT (POSIX); `serve run` must not
    inherit that, or its graceful stop on SIGINT never happens."""
    import signal
    import sys

    from loadtests.common import start_group

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with open(tmp_path / "out", "w") as f:
            start_group([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"], f).wait()
    finally:
        signal.signal(signal.SIGINT, before)
    assert (tmp_path / "out").read_text().strip() == "<built-in function default_int_handler>"


def test_serve_process_refuses_a_port_another_process_serves(tmp_path):
    """A service still going down (or anything else) on the port: no `serve run` starts,
    whose readiness check the old one could answer."""
    from loadtests.common import port_open, serve_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_open("127.0.0.1", port)
        with pytest.raises(TimeoutError, match="still served by another process"), \
                serve_process(Path("configs/load-random.yaml"), tmp_path, port=port, stop_timeout_s=1.0):
            pass
    assert not (tmp_path / "raw" / "serve-load-random.log").exists()
    assert not port_open("127.0.0.1", port)


@pytest.mark.integration
def test_compare_warms_a_fresh_service_up_before_its_first_cell(tmp_path):
    """`compare` on one service variant (~60 s): a warm-up run at the highest level with
    finished requests, then every cell measured with requests in its window."""
    main(["compare", "--config", "configs/load-random.yaml", "--port", str(_free_port()), "--policies", "chain",
          "off", "--levels", "2", "--warmup", "2", "--duration", "6", "--max-tokens", "16", "--out", str(tmp_path),
          "--ready-timeout", "120"])
    warm = [json.loads(x) for x in (tmp_path / "raw" / "warmup-ladder-r1-1-records.jsonl").read_text().splitlines()]
    assert warm and all(r["ok"] for r in warm)
    rows = read_rows(tmp_path / "compare.csv")
    assert [r["policy"] for r in rows] == ["chain", "off"]
    assert all(int(r["requests"]) > 0 and float(r["goodput_tok_s"]) > 0 for r in rows)
    assert not (tmp_path / "compare-stalls.csv").exists()


def test_a_cell_without_a_finished_request_is_measured_again(tmp_path, monkeypatch):
    import argparse

    from loadtests import experiment

    got = iter([{"policy": "off", "requests": 0, "goodput_tok_s": 0.0}, {"policy": "off", "requests": 5,
                                                                        "goodput_tok_s": 40.0}])
    monkeypatch.setattr(experiment, "measure_run", lambda *a: next(got))
    stalls: list[dict] = []
    row = experiment.measure_cell("http://x", argparse.Namespace(out=tmp_path), "off", 4, 1, stalls)
    assert row["requests"] == 5 and [r["requests"] for r in stalls] == [0]
    assert read_rows(tmp_path / "compare-stalls.csv")[0]["requests"] == "0"
    got = iter([{"policy": "off", "requests": 3, "goodput_tok_s": 30.0}])   # a second call would raise
    assert experiment.measure_cell("http://x", argparse.Namespace(out=tmp_path), "off", 4, 1, stalls)["requests"] == 3
    assert len(stalls) == 1


def test_warm_up_windows_double_until_a_request_finishes(tmp_path, monkeypatch):
    """At 16 users on one replica a 64-token request takes longer than an 8 s window, and
    every new window starts new requests: so each retry is twice as long as the last."""
    import argparse

    from loadtests import experiment

    shapes: list[str] = []

    def fake_run(url, shape, out, name, load):
        shapes.append(shape)
        done = shape.endswith(":32.0")          # only the third window is long enough
        rec = tmp_path / "raw" / f"{name}-records.jsonl"
        rec.parent.mkdir(parents=True, exist_ok=True)
        rec.write_text(json.dumps({"ok": done, "ttft": 0.5, "tokens": 64}) + "\n")

    monkeypatch.setattr(experiment, "run_shape", fake_run)
    monkeypatch.setattr(experiment, "wait_idle", lambda url: None)
    args = argparse.Namespace(out=tmp_path, levels=[1, 16], warmup=8.0, load=None)
    assert len(experiment.warm_up("http://x", args, "t")) == 1
    assert shapes == ["const:16:8.0", "const:16:16.0", "const:16:32.0"]
    shapes.clear()
    with pytest.raises(RuntimeError, match="finished no request"):       # windows of 5 and 10 s only
        experiment.warm_up("http://x", argparse.Namespace(out=tmp_path, levels=[16], warmup=2.0, load=None), "u",
                           tries=2)
    assert shapes == ["const:16:5.0", "const:16:10.0"]


def test_compare_runs_every_policy_at_a_level_before_the_next_level():
    from loadtests.experiment import compare_plan, variant_of

    plan = compare_plan([1, 4], ["perstep", "ladder", "chain", "off"], runs=2)
    assert [(r, v) for r, v, _ in plan] == [(1, "perstep"), (1, "ladder"), (2, "ladder"), (2, "perstep")]
    assert plan[1][2] == [(1, "ladder"), (1, "chain"), (1, "off"), (4, "ladder"), (4, "chain"), (4, "off")]
    assert variant_of("tree8") == "ladder" and variant_of("adaptive") == "config"


def test_variant_configs_rewrite_the_policy_and_the_controller(tmp_path):
    import yaml

    from deployments.config import AppArgs
    from loadtests.experiment import variant_config

    base = Path(__file__).resolve().parents[2] / "configs" / "load-default.yaml"
    for variant, kind, pricing, online in (("perstep", "perstep", True, False), ("perstep-local", "perstep", False, False),
                                           ("perstep-fit", "perstep", True, True), ("ladder", "ladder", True, False)):
        cfg = yaml.safe_load(variant_config(base, variant, tmp_path).read_text())
        a = AppArgs.model_validate(cfg["applications"][0]["args"])
        assert a.policy.kind == kind and a.controller.pricing is pricing and a.policy.online_costs is online
        assert a.controller.heartbeat_s == 0.25   # the rest of the controller section kept


def test_a_tie_reads_below_one_when_the_best_of_noisy_medians_is_taken():
    rng = np.random.default_rng(0)
    assert tie_ratio(0.0, 5, 3, rng=rng) == 1.0
    assert tie_ratio(0.1, 0, 3, rng=rng) == 1.0
    one, six = tie_ratio(0.1, 1, 3, rng=rng), tie_ratio(0.1, 6, 3, rng=rng)
    assert 0.98 < one < 1.02   # one rival: the median of the ratio is near 1
    assert six < 0.93 < one   # six: the best of six noisy medians is biased upward
    assert tie_ratio(0.1, 6, 15, rng=rng) > six   # more runs, less bias


def test_compare_table_says_what_noise_alone_would_show(tmp_path):
    path = tmp_path / "compare.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["policy", "run", "users", "goodput_tok_s", "tree_size"])
        w.writeheader()
        for p, xs in (("perstep", [9, 10, 11]), ("chain", [9, 10, 11]), ("tree", [9, 10, 11]), ("off", [2, 2, 2])):
            for run, x in enumerate(xs, 1):
                w.writerow({"policy": p, "run": run, "users": 4, "goodput_tok_s": x, "tree_size": 1})
    line = compare_table(path).splitlines()[-1]
    # chain and tree are contenders (off is not): cv pooled over the four cells
    assert line.startswith("perstep / best other if perstep served exactly like its contenders")
    assert "4: 0.9" in line and "2 contender(s)" in line and "; geometric mean 0.9" in line

"""The online step-cost table's runner (loadtests.online_costs): the config it serves and
the pooling of the replicas' cost cells across status snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.online_costs import cell_rows, online_config, pool, table_lines

ROOT = Path(__file__).resolve().parents[2]


def test_the_served_config_turns_online_costs_on_and_keeps_the_rest():
    cfg = online_config(ROOT / "configs" / "load-default.yaml", 8441)
    args = cfg["applications"][0]["args"]
    assert args["policy"]["online_costs"] is True and args["policy"]["kind"] == "perstep"
    assert cfg["http_options"] == {"host": "127.0.0.1", "port": 8441}


def cell(rows, nodes, steps, table, corrected, measured):
    return {"rows": rows, "nodes": nodes, "steps": steps, "table_s": table, "corrected_s": corrected,
            "measured_s": measured}


def test_cells_pool_over_replicas_and_snapshots_weighted_by_steps():
    status = {"replicas": {"a": {"cost_cells": [cell(1, 0, 30, 0.01, 0.012, 0.013), cell(4, 4, 10, 0.02, 0.03, 0.03)],
                                 "cost_factors": [1, 1, 1]},
                           "b": {"cost_cells": None}}}   # online_costs off: no cells
    rows = cell_rows(status, 1.0) + [{"t": 2.0, "replica": "a", **cell(1, 0, 10, 0.01, 0.016, 0.017)}]
    assert len(rows) == 3
    got = pool(rows)
    assert [(c["rows"], c["nodes"], c["weight"]) for c in got] == [(1, 0, 40.0), (4, 4, 10.0)]
    assert got[0]["corrected_s"] == pytest.approx((30 * 0.012 + 10 * 0.016) / 40)
    assert got[0]["measured_s"] == pytest.approx((30 * 0.013 + 10 * 0.017) / 40)
    lines = table_lines(got, min_weight=20)
    assert len(lines) == 2 + 1 + 1          # header, the 1-row cell (the 4-row one has too few steps), all
    assert lines[2].startswith("| 1 | 0 | 40 | 10.0 | 13.0 | 14.0 |")
    assert lines[-1].startswith("| all | all | 50 |")

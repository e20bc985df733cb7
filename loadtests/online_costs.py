"""The online step-cost correction on a busy service: the startup table, the corrected
one, and the measured step times, by row count and tree size, in one table.

Serves ``--config`` with ``policy.online_costs: true`` (all else as the config says),
drives it with Locust (``loadtests/locustfile.py``, ``--shape``: by default 2, 4 then 8
users, 60 s each, held-out chat prompts), and reads ``GET /v1/speculation`` every
``--period`` seconds. Each replica reports its fit's cells (``CostFit.cells``): per
(row count, verified-node bin), the decayed mean step seconds (drafting + verify) that
the startup table predicts, that the corrected table predicts, and that the engine
measured, over its last ~500 steps. ``pool`` averages the snapshots, each cell weighted
by its steps in each: the run's mean, recent steps counted more than once where two
snapshots overlap.

    python -m loadtests.online_costs --config configs/load-default.yaml \\
        --shape up:2,4,8:60 --out docs/load/online-costs

Writes ``cells.csv`` (every snapshot's cells), ``cost-table.md`` (the pooled table, the
factors at the end, goodput) under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import requests
import yaml

from loadtests.common import (
    ROOT,
    LoadArgs,
    StatusPoller,
    get_status,
    locust_command,
    log,
    read_records,
    run_locust,
    serve_process,
    wait_idle,
)
from loadtests.shapes import parse_shape, total_duration

KEYS = ("table_s", "corrected_s", "measured_s")


def online_config(config: Path, port: int) -> dict:
    """``config`` with ``policy.online_costs`` on, served on loopback at ``port``."""
    cfg = copy.deepcopy(yaml.safe_load(config.read_text()))
    cfg["applications"][0]["args"].setdefault("policy", {})["online_costs"] = True
    cfg.setdefault("http_options", {}).update(host="127.0.0.1", port=port)
    return cfg


def cell_rows(status: Mapping, t: float) -> list[dict]:
    """One ``/v1/speculation`` answer -> one row per replica and cell."""
    return [{"t": round(t, 1), "replica": rid, **c, "factors": r.get("cost_factors")}
            for rid, r in status.get("replicas", {}).items() for c in r.get("cost_cells") or ()]


def pool(rows: Iterable[Mapping]) -> list[dict]:
    """Per (rows, nodes), over replicas and snapshots: the step-weighted mean of each
    seconds column, and the snapshots' summed steps (``weight``)."""
    acc: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        a = acc.setdefault((int(r["rows"]), int(r["nodes"])), [0.0] * (1 + len(KEYS)))
        w = float(r["steps"])
        a[0] += w
        for i, k in enumerate(KEYS):
            a[1 + i] += w * float(r[k])
    return [{"rows": b, "nodes": n, "weight": a[0], **{k: a[1 + i] / a[0] for i, k in enumerate(KEYS)}}
            for (b, n), a in sorted(acc.items()) if a[0] > 0]


def nodes_label(n: int) -> str:
    return "0" if n == 0 else ("1" if n == 1 else f"{n}-{2 * n - 1}")


def table_lines(cells: list[dict], min_weight: float) -> list[str]:
    """The markdown table of ``pool``'s cells with at least ``min_weight`` steps, and a
    step-weighted total row."""
    lines = ["| rows | verified nodes | steps (pooled) | startup table ms | corrected ms | measured ms "
             "| corrected / measured | startup / measured |", "|---|---|---|---|---|---|---|---|"]
    shown = [c for c in cells if c["weight"] >= min_weight]
    for c in shown:
        lines.append(f"| {c['rows']} | {nodes_label(c['nodes'])} | {c['weight']:.0f} | {1e3 * c['table_s']:.1f} "
                     f"| {1e3 * c['corrected_s']:.1f} | {1e3 * c['measured_s']:.1f} "
                     f"| {c['corrected_s'] / c['measured_s']:.2f} | {c['table_s'] / c['measured_s']:.2f} |")
    w = sum(c["weight"] for c in cells)
    if w > 0:
        mean = {k: sum(c["weight"] * c[k] for c in cells) / w for k in KEYS}
        lines.append(f"| all | all | {w:.0f} | {1e3 * mean['table_s']:.1f} | {1e3 * mean['corrected_s']:.1f} "
                     f"| {1e3 * mean['measured_s']:.1f} | {mean['corrected_s'] / mean['measured_s']:.2f} "
                     f"| {mean['table_s'] / mean['measured_s']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "load-default.yaml")
    ap.add_argument("--shape", default="up:2,4,8:60", help="a loadtests.shapes spec")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--period", type=float, default=15.0, help="seconds between two status snapshots")
    ap.add_argument("--min-steps", type=float, default=20.0, help="cells with fewer pooled steps are not shown")
    ap.add_argument("--port", type=int, default=8441)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "load" / "online-costs")
    ap.add_argument("--work", type=Path, default=ROOT / "docs" / "load" / "raw" / "online-costs",
                    help="config, logs and per-request records (not committed)")
    a = ap.parse_args(argv)
    command = "python -m loadtests.online_costs " + " ".join(argv if argv is not None else sys.argv[1:])
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    cfg_path = a.work / "config-online-costs.yaml"
    cfg_path.write_text(yaml.safe_dump(online_config(a.config.resolve(), a.port), sort_keys=False))
    prefix = a.work / "locust"
    Path(f"{prefix}-records.jsonl").unlink(missing_ok=True)
    duration = total_duration(parse_shape(a.shape))
    with serve_process(cfg_path, a.work, port=a.port) as url:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        wait_idle(url)
        cmd = locust_command(url, a.shape, prefix, LoadArgs(max_tokens=a.max_tokens, model=model, chat=True),
                             stop_timeout_s=60)
        log(" ".join(cmd[2:]))
        poller = StatusPoller(url, a.period, cell_rows).start()
        rc, wall = run_locust(cmd, Path(f"{prefix}-locust.log"), duration + 180)
        poller.stop()
        final = get_status(url) or {}
    rows = poller.rows
    with open(a.out / "cells.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["t", "replica", "rows", "nodes", "steps", *KEYS, "factors"])
        w.writeheader()
        w.writerows(rows)
    recs = [r for r in read_records(Path(f"{prefix}-records.jsonl")) if r.get("ok")]
    tokens = sum(r.get("tokens") or 0 for r in recs)
    factors = {rid: r.get("cost_factors") for rid, r in final.get("replicas", {}).items()}
    ratios = {rid: (r.get("cost_correction"), r.get("step_time_over_table"))
              for rid, r in final.get("replicas", {}).items()}
    lines = [
        "# The online step-cost correction on a busy service", "",
        "```bash", command, "```", "",
        f"`{a.config.name}` with `policy.online_costs: true`, Locust `{a.shape}` (chat, {a.max_tokens} tokens), "
        f"locust rc {rc}, {wall:.0f} s, {len(recs)} requests, {tokens} tokens ({tokens / max(wall, 1e-9):.1f} tok/s "
        f"over the Locust run). Status read every {a.period:g} s ({len({r['t'] for r in rows})} snapshots); "
        "each row: one (row count, verified-node bin) cell, mean step seconds (drafting + verify) over the "
        "snapshots, weighted by the cell's decayed steps in each. *startup table*: what the table measured "
        "at startup predicts for those steps; *corrected*: what the table the allocation priced on (as it stood at each "
        f"snapshot) predicts; *measured*: the engine's clock. Cells under {a.min_steps:g} pooled steps are left out "
        "(the *all* row counts them).", "",
        *table_lines(pool(rows), a.min_steps), "",
        f"Factors at the end (draft, base, extra; guarded): {factors}. "
        f"Corrected / startup and measured / startup (the replicas' `step_cost_correction`, "
        f"`step_time_over_table`): {ratios}.", "",
    ]
    (a.out / "cost-table.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

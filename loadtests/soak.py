"""Soak experiment: Locust at a moderate, constant load for ten minutes; the resident
memory of every engine replica must stay flat after warm-up and every KV block must be
free at the end.

Starts ``serve run`` (``loadtests.overload.service_config``: fixed replicas and limits),
runs the Locust users of ``loadtests/locustfile.py`` at ``--users`` for ``--duration``
seconds and polls ``GET /v1/speculation`` every ``--period`` seconds for each replica's
``rss_bytes`` (from its heartbeat), KV cache usage, running and waiting requests.

RSS growth per replica = median RSS over the last ``--window`` seconds of load divided
by the median over the ``--window`` seconds right after ``--warmup``, minus one; the bar
is < 5 %. At the end (load stopped, engines drained) every replica must report a KV cache
usage of zero, and the engines must have finished every request the clients saw succeed.

    python -m loadtests.soak --model default --users 4 --duration 600 --out docs/reliability

Writes ``soak.csv`` (one row per poll and replica), ``soak-summary.json`` and
``soak-rss.png``. Run it under the shared lock on shared machines.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import requests

from loadtests.common import (
    StatusPoller,
    constant_load,
    log,
    read_records,
    serve_process,
    wait_idle,
)
from loadtests.overload import prepare_run, run_parser, service_config


def rss_rows(status: dict, t: float) -> list[dict]:
    """The ``StatusPoller`` rows of one ``/v1/speculation`` answer: one per replica."""
    return [{"t": round(t, 1), "replica": rid, "rss_mb": round((r.get("rss_bytes") or 0) / 2**20, 2),
             "kv_cache_usage": r.get("kv_cache_usage"), "active": r["active"],
             "queued": r["queued"], "tokens_per_s": round(r.get("tokens_per_s", 0.0), 1)}
            for rid, r in status.get("replicas", {}).items()]


def rss_growth(rows: list[dict], warmup_s: float, window_s: float, end_s: float) -> dict:
    out = {}
    for rid in sorted({r["replica"] for r in rows}):
        mine = [r for r in rows if r["replica"] == rid and r["rss_mb"] > 0]
        base = [r["rss_mb"] for r in mine if warmup_s <= r["t"] < warmup_s + window_s]
        last = [r["rss_mb"] for r in mine if end_s - window_s <= r["t"] < end_s]
        if not base or not last:
            out[rid] = {"samples": len(mine), "note": "replica not present over the whole run"}
            continue
        b, e = statistics.median(base), statistics.median(last)
        out[rid] = {"samples": len(mine), "rss_after_warmup_mb": b, "rss_end_mb": e, "growth_pct": round(100 * (e - b) / b, 2),
                    "rss_min_mb": min(r["rss_mb"] for r in mine), "rss_max_mb": max(r["rss_mb"] for r in mine)}
    return out


def plot(rows: list[dict], warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for rid in sorted({r["replica"] for r in rows}):
        mine = [r for r in rows if r["replica"] == rid and r["rss_mb"] > 0]
        ax.plot([r["t"] for r in mine], [r["rss_mb"] for r in mine], label=f"replica {rid}")
    ax.axvline(warmup_s, color="grey", ls="--", lw=1, label="end of warm-up")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("Engine replica resident memory under constant load")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = run_parser(__doc__, users=4, duration=600, replicas=2, port=8012)
    ap.add_argument("--warmup", type=float, default=120.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--period", type=float, default=5.0)
    a = ap.parse_args(argv)
    work, cfg_path = prepare_run(a, "soak", service_config(a.model, a.replicas, a.max_batch, 2 * a.max_batch, 64))
    prefix = work / "locust"
    with serve_process(cfg_path, work, port=a.port) as url:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        before = wait_idle(url)["counters"]
        poller = StatusPoller(url, a.period, rss_rows).start()
        rc, wall = constant_load(url, a.users, a.duration, prefix, a.max_tokens, 120, model)
        poller.stop()
        end = wait_idle(url, 120)
    records = read_records(Path(f"{prefix}-records.jsonl"))
    ok = sum(1 for r in records if r["ok"])
    growth = rss_growth(poller.rows, a.warmup, a.window, min(a.duration, max(r["t"] for r in poller.rows)))
    tokens = sum(r.get("tokens", 0) for r in records)
    summary = {
        "model": a.model, "users": a.users, "duration_s": a.duration, "warmup_s": a.warmup, "window_s": a.window,
        "replicas": a.replicas, "max_tokens": a.max_tokens, "locust_rc": rc, "locust_wall_s": round(wall, 1),
        "requests": len(records), "ok": ok, "failed": len(records) - ok,
        "failed_statuses": sorted({r["status"] for r in records if not r["ok"]}),
        "generated_tokens": tokens, "tokens_per_s": round(tokens / a.duration, 1),
        "server_finished": end["counters"]["requests"] - before["requests"],
        "server_aborted": end["counters"]["requests_aborted"] - before["requests_aborted"],
        "rss": growth,
        "max_growth_pct": max((g["growth_pct"] for g in growth.values() if "growth_pct" in g), default=None),
        "kv_cache_usage_at_end": {k: r.get("kv_cache_usage") for k, r in end["replicas"].items()},
    }
    summary["pass"] = (summary["max_growth_pct"] is not None and summary["max_growth_pct"] < 5.0
                       and all(v == 0 for v in summary["kv_cache_usage_at_end"].values())
                       and summary["failed"] == 0 and summary["server_aborted"] == 0)
    with open(a.out / "soak.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(poller.rows[0]))
        w.writeheader()
        w.writerows(poller.rows)
    (a.out / "soak-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(poller.rows, a.warmup, a.out / "soak-rss.png")
    log(f"soak: {'PASS' if summary['pass'] else 'FAIL'}")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

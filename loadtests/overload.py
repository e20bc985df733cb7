"""Overload experiment: far more concurrent users than the service admits, and an account
of every request.

Starts ``serve run`` on a config derived from ``configs/cluster.yaml`` with tight
per-replica limits (``max_ongoing_requests``, ``max_queued_requests``), runs the Locust
users of ``loadtests/locustfile.py`` at a constant ``--users`` (closed loop, no think
time, streaming), then checks, from the per-request records and the server counters:

* every request Locust completed was answered: 200, or 503/429 with ``Retry-After`` and
  an OpenAI error body, refusals within a second or two (``p99``/max below);
* none hung and none was cut off: Locust stops with ``--stop-timeout`` letting every
  in-flight request finish; the engines finished exactly as many requests as the
  clients saw succeed, aborted none, and end idle with every KV block free.

    python -m loadtests.overload --model random --users 64 --duration 60 --out docs/reliability

Writes ``overload-summary.json`` and ``overload-latency.csv`` (per-second answered
counts and latencies by status). Run it under the shared lock on shared machines.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import threading
import time
from pathlib import Path

import requests
import yaml

from loadtests.common import ROOT, constant_load, percentile, read_records, serve_process, wait_idle


def service_config(model: str, replicas: int, max_batch: int, max_ongoing: int, max_queued: int,
                   retry_after_s: float = 1.0, max_context: int = 1024) -> dict:
    """``configs/cluster.yaml`` with a fixed replica count and the given limits."""
    cfg = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text()))
    args = cfg["applications"][0]["args"]
    args.update(model=model, max_batch_size=max_batch, max_context=max_context)
    rep = args.setdefault("replica", {})
    rep.pop("autoscaling", None)
    rep.update(num_replicas=replicas, max_ongoing_requests=max_ongoing, max_queued_requests=max_queued,
               retry_after_s=retry_after_s, num_cpus=0.5, torch_threads=1)
    return cfg


def summarize(records: list[dict]) -> dict:
    by: dict[str, list[float]] = {}
    for r in records:
        key = str(r["status"]) if r["ok"] or r["status"] != 200 else "200-stream-error"
        by.setdefault(key, []).append(r["t1"] - r["t0"])
    return {k: {"count": len(v), "p50_s": round(percentile(v, 0.5), 3), "p99_s": round(percentile(v, 0.99), 3),
                "max_s": round(max(v), 3)}
            for k, v in sorted(by.items())}


def probe_refusal(url: str, model: str, n: int = 40) -> dict:
    """While Locust saturates the service, a few plain requests until one is refused: the
    status, ``Retry-After`` and body of a refusal (``ok``: the probe's admitted requests)."""
    out: dict = {"ok": 0, "refusal": None}
    for _ in range(n):
        t0 = time.time()
        r = requests.post(f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 4}, timeout=120)
        if r.status_code in (429, 503):
            out["refusal"] = {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                              "seconds": round(time.time() - t0, 3), "body": r.json()}
            break
        out["ok"] += r.status_code == 200
    return out


def run_parser(doc: str, *, users: int, duration: int, replicas: int, port: int) -> argparse.ArgumentParser:
    """The arguments every reliability run shares (overload, soak)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random", choices=["random", "default"])
    ap.add_argument("--users", type=int, default=users)
    ap.add_argument("--duration", type=int, default=duration)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=replicas)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability")
    ap.add_argument("--work", type=Path, default=Path("/tmp/treespark-reliability"),
                    help="serve log, config and Locust records go here")
    return ap


def prepare_run(a: argparse.Namespace, name: str, cfg: dict) -> tuple[Path, Path]:
    """Create the output and work folders; write the service config. -> (work, config path)."""
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.work / name
    work.mkdir(parents=True, exist_ok=True)
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return work, cfg_path


def main(argv: list[str] | None = None) -> None:
    ap = run_parser(__doc__, users=64, duration=60, replicas=1, port=8011)
    ap.add_argument("--max-ongoing", type=int, default=16)
    ap.add_argument("--max-queued", type=int, default=16)
    ap.add_argument("--stop-timeout", type=int, default=120)
    a = ap.parse_args(argv)
    work, cfg_path = prepare_run(a, "overload", service_config(a.model, a.replicas, a.max_batch,
                                                               a.max_ongoing, a.max_queued))
    prefix = work / "locust"
    with serve_process(cfg_path, work, port=a.port) as url:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        before = wait_idle(url)["counters"]
        probe: dict = {}
        t = threading.Thread(target=lambda: (time.sleep(min(20, a.duration / 3)), probe.update(probe_refusal(url, model))))
        t.start()
        rc, wall = constant_load(url, a.users, a.duration, prefix, a.max_tokens, a.stop_timeout, model)
        t.join()
        after_status = wait_idle(url, 60)
        after = after_status["counters"]
    records = read_records(Path(f"{prefix}-records.jsonl"))
    ok = sum(1 for r in records if r["ok"])
    refused = sum(1 for r in records if r["status"] in (429, 503))
    other = [r for r in records if not r["ok"] and r["status"] not in (429, 503)]
    finished = after["requests"] - before["requests"]
    aborted = after["requests_aborted"] - before["requests_aborted"]
    summary = {
        "model": a.model, "users": a.users, "duration_s": a.duration, "max_tokens": a.max_tokens,
        "replicas": a.replicas, "max_batch_size": a.max_batch, "max_ongoing_requests": a.max_ongoing,
        "max_queued_requests": a.max_queued, "locust_rc": rc, "locust_wall_s": round(wall, 1),
        "requests": len(records), "ok_200": ok, "refused_429_503": refused, "other_failures": len(other),
        "other_examples": other[:5], "server_finished": finished, "server_aborted": aborted,
        "probe_refusal": probe, "latency_by_status": summarize(records),
        "kv_cache_usage_at_end": {k: r.get("kv_cache_usage") for k, r in after_status["replicas"].items()},
    }
    # every admitted request finished in an engine (the probe's admitted ones too), none aborted
    summary["accounted"] = not other and aborted == 0 and finished == ok + probe.get("ok", 0)
    (a.out / "overload-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(a.out / "overload-latency.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["status", "count", "p50_s", "p99_s", "max_s"])
        for k, v in summary["latency_by_status"].items():
            w.writerow([k, v["count"], v["p50_s"], v["p99_s"], v["max_s"]])
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

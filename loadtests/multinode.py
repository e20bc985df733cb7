"""Multi-node experiments on a local Ray cluster (``loadtests.cluster``: a head and two
worker nodes on this machine), under Locust load, on the tiny random pair (``--pair
default``: the default pair and the served default policy, one thread a replica; slow on a
2-core machine, the serving path is the same).

* ``fault``: streaming and non-streaming users at a constant load; a worker node is
  killed (SIGKILL to its raylet and processes) partway. Counts what was sent, answered
  and failed, and from the API's counters in ``/metrics`` its re-issues after a replica
  died, the streams it resumed on another replica, the streams that ended with an error
  event and the pause a resumed stream's client saw (``ingress_report``); how long the
  controller took to drop the dead replica, when the replacement registered and got its
  first budget, and checks that nothing hung (every request answered within the client's
  patience; Locust ends within its stop timeout). The users decode greedily (or, with
  ``--temperature``, sample with a seed each), so every answer, resumed or not, must
  equal the answer to the same prompt (and seed) sent again once the load is over
  (``answer_check``: one reference request per prompt, or per request at T > 0, on the
  healed cluster).
* ``ramp``: a Locust ramp up and down drives Serve autoscaling 1 -> 3 -> 1 replicas
  across the workers; records each new replica's time to its first controller budget,
  each replica's price (theta) and the goodput over time, and every failed request.

    python -m loadtests.multinode fault --out docs/multinode
    python -m loadtests.multinode ramp --out docs/multinode

Each writes ``<kind>-timeline.csv`` (per status poll), ``<kind>-requests.csv`` (per
second: answered, failed, tokens), ``<kind>-summary.json`` and ``<kind>.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

from deployments.config import (
    AppArgs,
    AutoscalingArgs,
    BudgetArgs,
    ControllerArgs,
    LimitArgs,
    PolicyArgs,
    ReplicaArgs,
)
from loadtests.cluster import WORKER_RESOURCE, ClusterSpec, local_cluster
from loadtests.common import (
    ROOT,
    LoadArgs,
    StatusPoller,
    env,
    get_status,
    locust_command,
    log,
    read_records,
)
from loadtests.shapes import parse_shape, users_at

MODEL = {"random": "treespark-random", "default": "treespark-smollm2"}
HEARTBEAT_TIMEOUT_S = 2.0


# the price follows the load per replica (configs/cluster.yaml's ladder, thresholds scaled to a
# few users): with the random pair's drafter nothing is accepted, so a cost-model policy would
# learn to price speculation off and the timeline would show one flat price
LADDER = PolicyArgs(kind="ladder", thresholds=[1.0, 2.0, 4.0], budgets=[
    BudgetArgs(theta=0.02, node_cap=32, branch_cap=4), BudgetArgs(theta=0.10, node_cap=12, branch_cap=2),
    BudgetArgs(theta=0.25, node_cap=4, branch_cap=1), BudgetArgs(theta=1.0, node_cap=0, branch_cap=1)])


def app_args(replica: ReplicaArgs, retries: int, pair: str = "random") -> AppArgs:
    """The random pair under ``LADDER``, or the default pair under the served default policy."""
    controller = ControllerArgs(name="treespark-multinode", heartbeat_s=0.25, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    limits = LimitArgs(replica_retries=retries)
    if pair == "default":
        return AppArgs(model="default", max_batch_size=8, max_context=1024, replica=replica, limits=limits,
                       controller=controller)
    return AppArgs(model="random", vocab_size=512, max_batch_size=8, max_context=512,
                   replica=replica, limits=limits, controller=controller, policy=LADDER)


def replica_rows(st: dict, t: float) -> list[dict]:
    """One row per replica the controller knows at ``t``."""
    return [{"t": round(t, 3), "replica": rid, "node": (r.get("node_id") or "")[:8], "theta": r["budget"]["theta"],
             "node_cap": r["budget"]["node_cap"], "source": r["budget_source"], "active": r["active"],
             "queued": r["queued"], "tokens_per_s": r["tokens_per_s"], "first_budget_s": r.get("first_budget_s"),
             "last_seen_s": round(r["last_seen_s"], 3),
             "dropped": st["dropped"]} for rid, r in st["replicas"].items()] or \
        [{"t": round(t, 3), "replica": "", "dropped": st["dropped"]}]


def per_second(records: list[dict], t0: float, kind: str) -> dict[int, dict]:
    """Requests by the second (since ``t0``) they ended in: answered, failed, tokens."""
    out: dict[int, dict] = {}
    for r in records:
        s = int(r["t1"] - t0)
        b = out.setdefault(s, {"answered": 0, "failed": 0, "tokens": 0})
        b["answered" if r["ok"] else "failed"] += 1
        b["tokens"] += r["tokens"] if r["ok"] else 0
    return {s: {**b, "kind": kind} for s, b in out.items()}


# the API's counters (deployments.metrics.INGRESS_FAMILIES), summed over their labels
INGRESS_SAMPLES = ("request_retries_total", "stream_resumes_total", "stream_failures_total",
                   "stream_resume_seconds_sum", "stream_resume_seconds_count")


def ingress_counters(metrics_text: str) -> dict[str, float]:
    """The API's resend and resume counters from ``/metrics`` text (``stream_failures_total``
    also by code, as ``stream_failures_total:<code>``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(INGRESS_SAMPLES, 0.0)
    for fam in text_string_to_metric_families(metrics_text):
        for smp in fam.samples:
            name = smp.name.removeprefix("treespark:")
            if name in out:
                out[name] += smp.value
                if "code" in smp.labels:
                    out[f"{name}:{smp.labels['code']}"] = out.get(f"{name}:{smp.labels['code']}", 0.0) + smp.value
    return out


def get_ingress_counters(url: str) -> dict[str, float]:
    import requests

    r = requests.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return ingress_counters(r.text)


def ingress_report(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the API did about the fault, between two readings of its counters: re-issues,
    streams resumed and failed (by error code), and the mean pause of a resumed stream."""
    def d(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)

    resumed = d("stream_resumes_total")
    return {
        "api_retries": int(d("request_retries_total")),
        "streams_resumed": int(resumed),
        "streams_failed": int(d("stream_failures_total")),
        "streams_failed_by_code": {k.split(":", 1)[1]: int(d(k)) for k in sorted(after) if ":" in k and d(k)},
        "resumed_stream_added_latency_s": round(d("stream_resume_seconds_sum") / resumed, 3) if resumed else None,
    }


_SERVE_EVENT = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) controller \d+ -- (Adding|Removing) (\d+) "
                          r"replicas? (?:to|from) Deployment\(name='Replica'")


def serve_scaling(session_dir: Path, t0: float) -> list[dict]:
    """Serve's own scaling decisions for the engine replicas, from its controller log:
    (seconds since ``t0``, +n added / -n removed)."""
    out = []
    for f in (session_dir / "logs" / "serve").glob("controller_*.log"):
        for line in f.read_text(errors="replace").splitlines():
            if m := _SERVE_EVENT.match(line):
                t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0
                out.append({"t": round(t, 2), "change": int(m[3]) * (1 if m[2] == "Adding" else -1)})
    return sorted(out, key=lambda e: e["t"])


def session_dir() -> Path:
    import ray

    return Path(ray._private.worker.global_worker.node.get_session_dir_path())


def start_locust(url: str, shape: str, prefix: Path, stream: bool, max_tokens: int, stop_timeout_s: int,
                 model: str = MODEL["random"], temperature: float = 0.0) -> subprocess.Popen:
    Path(f"{prefix}-records.jsonl").unlink(missing_ok=True)
    cmd = locust_command(url, shape, prefix, LoadArgs(max_tokens=max_tokens, temperature=temperature, stream=stream,
                                                      model=model), stop_timeout_s=stop_timeout_s)
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=open(f"{prefix}-locust.log", "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)


def write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


def wait_replicas(url: str, n: int, timeout_s: float) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        st = get_status(url)
        if st and len(st["replicas"]) == n and all(r["budget_source"] == "controller" for r in st["replicas"].values()):
            return st
        time.sleep(0.25)
    raise TimeoutError(f"{n} replicas not registered within {timeout_s} s")


def answer_key(record: dict, temperature: float) -> tuple[int, int]:
    """What a request's answer is a function of: its prompt, and at T > 0 its seed (a
    client's seed makes a sampled request reproducible); -1 where nothing else matters."""
    return record.get("prompt", -1), record.get("seed", -1) if temperature > 0 else -1


def reference_texts(url: str, model: str, keys: set[tuple[int, int]], max_tokens: int,
                    temperature: float) -> dict[tuple[int, int], str]:
    """Each (prompt, seed) of ``keys`` (prompt: an index into the held-out split, as the
    Locust users sent it) answered once more, not streamed: what every answer to it must
    equal."""
    import requests

    from treespark.models.prompts import load_prompts

    texts = [p.text for p in load_prompts("heldout")]
    out = {}
    for prompt, seed in sorted(keys):
        body = {"model": model, "prompt": texts[prompt], "max_tokens": max_tokens, "temperature": temperature,
                "seed": max(seed, 0), "ignore_eos": True}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        out[(prompt, seed)] = r.json()["choices"][0]["text"]
    return out


def answer_check(records: list[dict], reference: dict[tuple[int, int], str], temperature: float) -> dict:
    """The answered requests whose text differs from their (prompt, seed)'s reference."""
    checked = [r for r in records if r["ok"] and answer_key(r, temperature) in reference]
    differ = [r for r in checked if r["text"] != reference[answer_key(r, temperature)]]
    return {"checked": len(checked), "differ": len(differ),
            "differ_prompts": sorted({r["prompt"] for r in differ})[:20]}


# -- fault ------------------------------------------------------------------------------------------

def fault(a: argparse.Namespace) -> dict:
    from deployments.app import build_app

    args = app_args(ReplicaArgs(num_cpus=0.5, torch_threads=1, num_replicas=2, resources={WORKER_RESOURCE: 1}),
                    retries=a.retries, pair=a.pair)
    model = MODEL[a.pair]
    work = a.work / "fault"
    work.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(workers=2, http_port=a.port, gcs_port=a.gcs_port, agent_port_base=a.gcs_port + 10)
    with local_cluster(spec, lambda: build_app(args)) as cl:
        before = wait_replicas(cl.url, 2, a.startup_timeout)
        counters_before = get_ingress_counters(cl.url)
        victim = before["replicas"][sorted(before["replicas"])[0]]["node_id"]
        lost = [rid for rid, r in before["replicas"].items() if r["node_id"] == victim]
        log(f"replicas on nodes {[r['node_id'][:8] for r in before['replicas'].values()]}; killing {victim[:8]} at "
            f"t = {a.kill_at} s")
        poller = StatusPoller(cl.url, 0.1, replica_rows).start()
        shape = f"const:{a.users}:{a.duration}"
        procs = {kind: start_locust(cl.url, shape, work / kind, kind == "stream", a.max_tokens, a.stop_timeout,
                                    model, a.temperature) for kind in ("stream", "plain")}
        time.sleep(max(a.kill_at - (time.time() - poller.t0), 0))
        t_kill = cl.kill_worker(victim) - poller.t0
        rcs = {k: p.wait(a.duration + a.stop_timeout + 120) for k, p in procs.items()}
        t_end = time.time() - poller.t0
        time.sleep(3)
        poller.stop()
        ingress = ingress_report(counters_before, get_ingress_counters(cl.url))
        scaling = serve_scaling(session_dir(), poller.t0)
        after = get_status(cl.url)
        recs = {k: read_records(work / f"{k}-records.jsonl") for k in ("stream", "plain")}
        sent = {answer_key(r, a.temperature) for rs in recs.values() for r in rs if r["ok"] and r.get("prompt", -1) >= 0}
        log(f"load over; {len(sent)} requests answered once more for the answer check")
        reference = reference_texts(cl.url, model, sent, a.max_tokens, a.temperature)
    return fault_summary(a, poller, work, t_kill, t_end, lost, victim, ingress, rcs, after, scaling, recs, reference)


def fault_summary(a, poller: StatusPoller, work: Path, t_kill: float, t_end: float, lost: list[str], victim: str,
                  ingress: dict, rcs: dict, after: dict | None, scaling: list[dict], recs: dict[str, list[dict]],
                  reference: dict[int, str]) -> dict:
    rows = poller.rows
    t0 = poller.t0
    seen_before = {r["replica"] for r in rows if r["t"] < t_kill}
    drop = next((r["t"] for r in rows if r["t"] > t_kill and not any(
        x["replica"] in lost for x in rows if x["t"] == r["t"])), None)
    # the lost replica's last heartbeat, as the controller saw it at its last poll
    last_hb = max((r["t"] - r["last_seen_s"] for r in rows if r["replica"] in lost), default=None)
    newcomers = [r for r in rows if r["t"] > t_kill and r["replica"] and r["replica"] not in seen_before]
    first_new = min(newcomers, key=lambda r: r["t"]) if newcomers else None
    new_budget = next((r["first_budget_s"] for r in newcomers if first_new and r["replica"] == first_new["replica"]
                       and r["first_budget_s"] is not None), None)
    # goodput back: the first second after the kill whose 3-s mean reaches 80 % of the mean before it
    tok = {}
    for rs in recs.values():
        for s, b in per_second(rs, t0, "").items():
            tok[s] = tok.get(s, 0) + b["tokens"]
    pre = [tok.get(s, 0) for s in range(5, int(t_kill))]
    pre_mean = sum(pre) / max(len(pre), 1)
    back = next((s for s in range(int(t_kill) + 1, int(t_end) - 2)
                 if sum(tok.get(s + j, 0) for j in range(3)) / 3 >= 0.8 * pre_mean), None)
    by_kind = {}
    for k, rs in recs.items():
        failed = [r for r in rs if not r["ok"]]
        by_kind[k] = {
            "sent": len(rs), "answered": len(rs) - len(failed), "failed": len(failed),
            "failed_statuses": sorted({r["status"] for r in failed}),
            "max_latency_s": round(max((r["t1"] - r["t0"] for r in rs), default=0), 2),
            "sent_during_fault": sum(1 for r in rs if r["t0"] - t0 <= t_kill <= r["t1"] - t0),
            "answer_check": answer_check(rs, reference, a.temperature),
        }
    summary = {
        "pair": a.pair, "temperature": a.temperature, "users_per_kind": a.users, "duration_s": a.duration, "max_tokens": a.max_tokens, "kill_at_s": round(t_kill, 2),
        "replica_retries": a.retries, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "killed_node": victim[:8], "lost_replicas": lost,
        "controller_dropped_after_s": None if drop is None else round(drop - t_kill, 2),
        "controller_dropped_after_last_heartbeat_s": None if drop is None or last_hb is None else round(drop - last_hb, 2),
        "serve_started_replacement_after_s": next((round(e["t"] - t_kill, 2) for e in scaling
                                                   if e["t"] > t_kill and e["change"] > 0), None),
        "replacement_registered_after_s": None if first_new is None else round(first_new["t"] - t_kill, 2),
        "replacement_first_budget_s": new_budget,
        "goodput_tok_s_before": round(pre_mean, 1),
        "goodput_back_after_s": None if back is None else back - round(t_kill, 2),
        "replacement_node": None if first_new is None else first_new["node"],
        "replicas_at_end": {rid: (r.get("node_id") or "")[:8] for rid, r in (after or {}).get("replicas", {}).items()},
        **ingress, "requests": by_kind, "locust_rc": rcs, "locust_end_s": round(t_end, 1),
        "hung": any(rc is None for rc in rcs.values()),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / "fault-timeline.csv", rows)
    sec = [{"t": s, **b} for k, rs in recs.items() for s, b in sorted(per_second(rs, t0, k).items())]
    write_csv(a.out / "fault-requests.csv", sec)
    (a.out / "fault-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from loadtests.multinode_report import plot_fault

    plot_fault(a.out / "fault-timeline.csv", a.out / "fault-requests.csv", t_kill, a.out / "fault.png")
    return summary


# -- ramp -------------------------------------------------------------------------------------------

def ramp(a: argparse.Namespace) -> dict:
    from deployments.app import build_app

    auto = AutoscalingArgs(min_replicas=1, max_replicas=3, target_ongoing_requests=a.target,
                           upscale_delay_s=a.upscale_delay, downscale_delay_s=a.downscale_delay,
                           look_back_period_s=a.look_back)
    args = app_args(ReplicaArgs(num_cpus=0.5, torch_threads=1, autoscaling=auto, resources={WORKER_RESOURCE: 1}),
                    retries=1)
    work = a.work / "ramp"
    work.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(workers=2, http_port=a.port, gcs_port=a.gcs_port, agent_port_base=a.gcs_port + 10,
                       env={"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"})
    stages = parse_shape(a.shape)
    with local_cluster(spec, lambda: build_app(args)) as cl:
        wait_replicas(cl.url, 1, 120)
        poller = StatusPoller(cl.url, 0.2, replica_rows).start()
        proc = start_locust(cl.url, a.shape, work / "ramp", True, a.max_tokens, a.stop_timeout)
        rc = proc.wait(sum(s.duration_s for s in stages) + a.stop_timeout + 120)
        t_load_end = time.time() - poller.t0
        log("load over; waiting for the scale-down to 1 replica")
        deadline = time.time() + a.downscale_delay + 90
        while time.time() < deadline:
            st = get_status(cl.url)
            if st and len(st["replicas"]) == 1:
                break
            time.sleep(0.5)
        time.sleep(3)
        poller.stop()
        scaling = serve_scaling(session_dir(), poller.t0)
    rows = poller.rows
    for r in rows:
        r["users"] = users_at(stages, r["t"]) or 0
    recs = read_records(work / "ramp-records.jsonl")
    t0 = poller.t0
    first_seen: dict[str, dict] = {}
    last_seen: dict[str, float] = {}
    budget_s: dict[str, float] = {}
    for r in rows:
        if r["replica"]:
            first_seen.setdefault(r["replica"], r)
            last_seen[r["replica"]] = r["t"]
            if r["first_budget_s"] is not None:
                budget_s.setdefault(r["replica"], r["first_budget_s"])
    counts: dict[float, int] = {}
    for r in rows:
        counts[r["t"]] = counts.get(r["t"], 0) + (1 if r["replica"] else 0)
    t_max = max(counts, key=lambda t: (counts[t], -t))
    failed = [r for r in recs if not r["ok"]]
    summary = {
        "shape": a.shape, "max_tokens": a.max_tokens, "target_ongoing_requests": a.target,
        "upscale_delay_s": a.upscale_delay, "downscale_delay_s": a.downscale_delay, "locust_rc": rc,
        "load_end_s": round(t_load_end, 1),
        "max_replicas": max(counts.values()), "max_replicas_at_s": t_max,
        "replicas_at_end": counts[max(counts)],
        "serve_scaling": scaling,
        "users_changes": [{"t": round(sum(s.duration_s for s in stages[:i]), 1), "users": st.users}
                          for i, st in enumerate(stages)],
        "replicas": [{"replica": rid, "node": r["node"], "registered_at_s": r["t"], "first_budget_s": budget_s.get(rid),
                      "last_seen_s": last_seen[rid]} for rid, r in first_seen.items()],
        "requests": {"sent": len(recs), "answered": len(recs) - len(failed), "failed": len(failed),
                     "failed_statuses": sorted({r["status"] for r in failed}),
                     "failed_at_s": [round(r["t1"] - t0, 1) for r in failed][:20]},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / "ramp-timeline.csv", rows)
    write_csv(a.out / "ramp-requests.csv", [{"t": s, **b} for s, b in sorted(per_second(recs, t0, "stream").items())])
    (a.out / "ramp-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from loadtests.multinode_report import plot_ramp

    plot_ramp(a.out / "ramp-timeline.csv", a.out / "ramp-requests.csv", a.out / "ramp.png")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    for name in ("fault", "ramp"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=ROOT / "docs" / "multinode")
        p.add_argument("--work", type=Path, default=Path("/tmp/treespark-multinode"),
                       help="Locust logs and per-request records go here")
        p.add_argument("--port", type=int, default=8220, help="Serve's HTTP port")
        p.add_argument("--gcs-port", type=int, default=6440, help="the head's GCS port (agents: +10 ...)")
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--stop-timeout", type=int, default=60)
    f = sub.choices["fault"]
    f.add_argument("--users", type=int, default=4, help="per kind (streaming, non-streaming)")
    f.add_argument("--duration", type=int, default=60)
    f.add_argument("--kill-at", type=float, default=20.0)
    f.add_argument("--retries", type=int, default=2, help="limits.replica_retries")
    f.add_argument("--temperature", type=float, default=0.0,
                   help="the users' temperature; > 0: each request sampled with a seed of its own")
    f.add_argument("--pair", default="random", choices=sorted(MODEL),
                   help="default: the default pair under the served default policy")
    f.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds for both replicas to register (the default pair's measure their step costs)")
    r = sub.choices["ramp"]
    r.add_argument("--shape", default="ramp:1,3,6:25")
    r.add_argument("--target", type=float, default=2.0, help="target_ongoing_requests per replica")
    r.add_argument("--upscale-delay", type=float, default=2.0)
    r.add_argument("--downscale-delay", type=float, default=8.0)
    r.add_argument("--look-back", type=float, default=5.0, help="Serve's averaging window (s)")
    a = ap.parse_args(argv)
    summary = fault(a) if a.kind == "fault" else ramp(a)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

"""The load-experiment runner: service up, Locust on a shape, speculation polled, CSV + PNG.

Two experiments, one runner:

* ``ramp``     one Locust run on a shape (default: a step ramp up and down); every
               second it reads ``GET /v1/speculation`` and writes ``timeline.csv``
               (users, theta, tree size and width, accepted tokens per round, goodput,
               p50/p99 latency over time) and ``timeline.png``;
* ``compare``  goodput side by side: for each policy (``adaptive`` = the configured
               policy; ``perstep``, ``perstep-local``, ``perstep-fit`` (with the online
               cost correction) and ``ladder``: service variants of
               the config; fixed baselines forced through ``POST /v1/speculation/override``
               on the ladder variant), each concurrency level and each of ``--runs`` runs,
               a constant-users Locust run; writes ``compare.csv``, ``compare.md``
               (medians and spreads) and ``compare.png``. Each fresh service is
               warmed up first (``warm_up``); a cell in which no request finished is
               measured again, its row kept in ``compare-stalls.csv``.

The service is started with ``serve run CONFIG`` (own process group, stopped with
SIGINT; ``--port`` rewrites the config's port) unless ``--url`` points at a running
one. Locust runs as its own process (gevent must be imported before anything else).

    python -m loadtests.experiment ramp --config configs/load-default.yaml --out docs/load/ramp
    python -m loadtests.experiment compare --config configs/load-default.yaml --out docs/load/compare
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import time
from pathlib import Path

import requests
import yaml

from loadtests.common import (
    LoadArgs,
    StatusPoller,
    locust_command,
    log,
    percentile,
    read_records,
    run_locust,
    serve_process,
    service_url,
    wait_healthy,
    wait_idle,
)
from loadtests.shapes import parse_shape, total_duration, users_at
from treespark.spec.budget import DEFAULT_BRANCH_CAP

# fixed baselines for ``compare`` (override budgets); ``adaptive`` releases the override
BASELINES: dict[str, dict | None] = {
    "adaptive": None,
    "chain": {"theta": 0.0, "node_cap": 4, "branch_cap": 1},
    "tree": {"theta": 0.02, "node_cap": 32, "branch_cap": 4},
    "off": {"theta": 0.0, "node_cap": 0, "branch_cap": 1},
}
# more fixed budgets, to find the best fixed chain and tree
BASELINES.update({
    "chain2": {"theta": 0.0, "node_cap": 2, "branch_cap": 1},
    "tree8": {"theta": 0.0, "node_cap": 8, "branch_cap": 2},
})
# policies that need their own service: the config's ``policy``/``controller`` rewritten
# (``compare`` starts one service per variant and run, with ``--config``)
VARIANTS: dict[str, dict] = {
    "perstep": {"policy": {"kind": "perstep", "max_nodes": 32, "max_branch": DEFAULT_BRANCH_CAP}},
    "perstep-local": {"policy": {"kind": "perstep", "max_nodes": 32, "max_branch": DEFAULT_BRANCH_CAP},
                      "controller": {"pricing": False}},
    # per-step on the startup table corrected online from measured steps (``policy.online_costs``)
    "perstep-fit": {"policy": {"kind": "perstep", "max_nodes": 32, "max_branch": DEFAULT_BRANCH_CAP, "online_costs": True}},
    "ladder": {"policy": {"kind": "ladder"}},
}
POLICIES = list(BASELINES) + [v for v in VARIANTS if v != "ladder"] + ["ladder"]


def variant_of(policy: str) -> str:
    """The service a policy runs on: its own variant, the ladder service for the fixed
    baselines (no per-step allocation there: an override budget is what is verified),
    or the config as given (``adaptive``)."""
    if policy in VARIANTS:
        return policy
    return "config" if policy == "adaptive" else "ladder"


def variant_config(config: Path, variant: str, out: Path) -> Path:
    """``config`` with the variant's ``args`` keys replaced (``controller`` merged)."""
    if variant == "config":
        return config
    cfg = yaml.safe_load(config.read_text())
    args = cfg["applications"][0]["args"]
    for k, v in VARIANTS[variant].items():
        args[k] = {**args.get(k, {}), **v} if k == "controller" else v
    path = out / "raw" / f"config-{variant}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# -- polling ----------------------------------------------------------------------------------

TIMELINE_FIELDS = ["t", "wall", "users", "replicas", "active", "queued", "queued_max", "batch_size", "theta", "node_cap",
                   "branch_cap", "tree_size", "width", "depth", "accepted_per_round", "step_s",
                   "generation_tokens", "goodput_tok_s", "requests_done", "p50_e2e_s", "p99_e2e_s",
                   "p50_ttft_s", "p99_ttft_s", "calib_ece_stored", "calib_ece_pushed", "policy_share",
                   "price_latency_max_s", "cost_draft", "cost_base", "cost_extra"]


def speculation_row(status: dict) -> dict:
    """One timeline row from a ``/v1/speculation`` answer (replica means weighted by batch)."""
    reps = list(status.get("replicas", {}).values())
    w = [max(r.get("batch_size", 0.0), 1e-9) for r in reps]
    tw = sum(w) or 1.0

    def wmean(key: str, src: str | None = None) -> float:
        if not reps:
            return float("nan")
        vals = [(r[src][key] if src else r.get(key, 0.0)) for r in reps]
        return sum(v * x for v, x in zip(vals, w, strict=True)) / tw

    cal = (status.get("calibration") or {}).get("report") or {}
    fitted = bool(reps) and all(r.get("cost_factors") for r in reps)
    return {
        "replicas": len(reps),
        "active": sum(r.get("active", 0) for r in reps),
        "queued": sum(r.get("queued", 0) for r in reps),
        "queued_max": max((r.get("queued", 0) for r in reps), default=0),   # the most on one replica
        "batch_size": sum(r.get("batch_size", 0.0) for r in reps),
        "theta": wmean("theta", "applied_budget"),
        "node_cap": wmean("node_cap", "applied_budget"),
        "branch_cap": wmean("branch_cap", "applied_budget"),
        "tree_size": wmean("mean_tree_size"),
        "width": wmean("mean_width"),
        "depth": wmean("mean_depth"),
        "accepted_per_round": wmean("accepted_per_round"),
        "step_s": wmean("step_s"),
        "generation_tokens": status.get("counters", {}).get("generation_tokens", 0.0),
        "policy_share": wmean("policy_share") if all("policy_share" in r for r in reps) else "",
        "price_latency_max_s": max((x for r in reps for x in r.get("price_latency_s") or ()), default=""),
        # the online correction of the replicas' step-cost tables (perstep with online_costs)
        **{k: sum(r["cost_factors"][i] * x for r, x in zip(reps, w, strict=True)) / tw if fitted else ""
           for i, k in enumerate(("cost_draft", "cost_base", "cost_extra"))},
        "calib_ece_stored": cal.get("ece_stored", ""),
        "calib_ece_pushed": cal.get("ece_pushed", ""),
    }


def timeline_rows(status: dict, t: float) -> list[dict]:
    """The ``StatusPoller`` row of one ``/v1/speculation`` answer."""
    return [{"t": round(t, 2), "wall": time.time(), **speculation_row(status)}]


def read_user_history(prefix: Path) -> list[tuple[float, int]]:
    """(unix time, user count) from Locust's ``_stats_history.csv``."""
    path = Path(f"{prefix}_stats_history.csv")
    if not path.exists():
        return []
    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            if row.get("Name") == "Aggregated":
                out.append((float(row["Timestamp"]), int(float(row["User Count"]))))
    return out


def finish_timeline(rows: list[dict], records: list[dict], history: list[tuple[float, int]],
                    stages, t_start: float, window_s: float = 10.0, goodput_s: float = 3.0) -> list[dict]:
    """Adds users, goodput (tokens/s over ``goodput_s``) and latency percentiles (requests
    finished in the last ``window_s``) to the polled rows."""
    done = sorted((r for r in records if r.get("ok")), key=lambda r: r["t1"])
    out = []
    for i, row in enumerate(rows):
        wall = row["wall"]
        users = [u for ts, u in history if ts <= wall]
        row = dict(row)
        row["users"] = users[-1] if users else (users_at(stages, wall - t_start) or 0)
        j = i
        while j > 0 and wall - rows[j - 1]["wall"] <= goodput_s + 1e-6:
            j -= 1
        if j < i:
            dt = wall - rows[j]["wall"]
            row["goodput_tok_s"] = (row["generation_tokens"] - rows[j]["generation_tokens"]) / dt
        else:
            row["goodput_tok_s"] = ""
        recent = [r for r in done if wall - window_s < r["t1"] <= wall]
        e2e = [r["t1"] - r["t0"] for r in recent]
        ttft = [r["ttft"] for r in recent if r.get("ttft") is not None]
        row.update(requests_done=sum(1 for r in done if r["t1"] <= wall),
                   p50_e2e_s=percentile(e2e, 0.5), p99_e2e_s=percentile(e2e, 0.99),
                   p50_ttft_s=percentile(ttft, 0.5), p99_ttft_s=percentile(ttft, 0.99))
        out.append(row)
    return out


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (("" if math.isnan(v) else f"{v:.4g}") if isinstance(v, float) else v)
                        for k, v in r.items()})


def set_override(url: str, budget: dict | None) -> None:
    r = requests.post(f"{url}/v1/speculation/override", json={"budget": budget}, timeout=10)
    r.raise_for_status()


# -- the experiments ---------------------------------------------------------------------------


def run_shape(url: str, shape: str, out: Path, name: str, load: LoadArgs,
              poll_s: float = 1.0) -> list[dict]:
    """One Locust run on ``shape`` with polling; returns the finished timeline rows."""
    stages = parse_shape(shape)
    raw = out / "raw"  # Locust's CSVs and log, the per-request records
    raw.mkdir(parents=True, exist_ok=True)
    prefix = raw / name
    for p in raw.glob(f"{name}-records.jsonl"):
        p.unlink()
    log(f"locust {shape} for {total_duration(stages):.0f} s ({name})")
    poller = StatusPoller(url, poll_s, timeline_rows).start()
    t_start = time.time()
    rc, _ = run_locust(locust_command(url, shape, prefix, load), raw / f"{name}-locust.log",
                       total_duration(stages) + 120)
    poller.stop()
    if rc != 0:
        raise RuntimeError(f"locust exited with {rc}; see {raw / f'{name}-locust.log'}")
    return finish_timeline(poller.rows, read_records(Path(f"{prefix}-records.jsonl")),
                           read_user_history(prefix), stages, t_start)


def experiment_ramp(url: str, args) -> Path:
    rows = run_shape(url, args.shape, args.out, "timeline", args.load)
    path = args.out / "timeline.csv"
    write_csv(path, rows, TIMELINE_FIELDS)
    log(f"wrote {path} ({len(rows)} rows)")
    from loadtests.report import plot_timeline, ramp_summary

    plot_timeline(path, args.out / "timeline.png", title=args.title)
    summary = ramp_summary(path)
    (args.out / "timeline-summary.md").write_text(summary + "\n")
    print(summary)
    return path


COMPARE_FIELDS = ["policy", "run", "users", "goodput_tok_s", "tokens", "seconds", "requests", "errors", "p50_e2e_s",
                  "p99_e2e_s", "p50_ttft_s", "p99_ttft_s", "tree_size", "width", "accepted_per_round",
                  "theta", "batch_size", "queued", "queued_max"]


def compare_order(levels, policies) -> list[tuple[int, str]]:
    """(users, policy) in the order the runs happen: level by level, every policy at one
    level before the next. The service drifts over the ~15 min the runs take (a run
    measured last came out 10 % faster than the same policy measured first), so a
    policy-by-policy order would credit that drift to whichever policy runs last."""
    return [(users, policy) for users in levels for policy in policies]


def measure_run(url: str, args, policy: str, users: int, run: int) -> dict:
    """One constant-users run of ``policy`` (its override set first); the measured row."""
    set_override(url, BASELINES.get(policy))
    wait_idle(url)
    name = f"cmp-{policy}-u{users}-r{run}"
    tl = run_shape(url, f"const:{users}:{args.warmup + args.duration}", args.out, name, args.load)
    t0 = tl[0]["wall"] if tl else 0.0
    win = [r for r in tl if args.warmup <= r["wall"] - t0 <= args.warmup + args.duration]
    recs = [r for r in read_records(args.out / "raw" / f"{name}-records.jsonl")
            if win and win[0]["wall"] <= r["t1"] <= win[-1]["wall"]]
    ok = [r for r in recs if r.get("ok")]
    secs = win[-1]["wall"] - win[0]["wall"] if len(win) > 1 else float("nan")
    toks = win[-1]["generation_tokens"] - win[0]["generation_tokens"] if len(win) > 1 else 0.0
    busy = [r for r in win if r["batch_size"]]

    def mean(key: str, src=busy) -> float | str:
        vals = [r[key] for r in src if r[key] != "" and r[key] == r[key]]
        return sum(vals) / len(vals) if vals else ""

    e2e = [r["t1"] - r["t0"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    row = {"policy": policy, "run": run, "users": users,
           "goodput_tok_s": toks / secs if secs == secs and secs else 0.0,
           "tokens": toks, "seconds": secs, "requests": len(ok), "errors": len(recs) - len(ok),
           "p50_e2e_s": percentile(e2e, 0.5), "p99_e2e_s": percentile(e2e, 0.99),
           "p50_ttft_s": percentile(ttft, 0.5), "p99_ttft_s": percentile(ttft, 0.99),
           "tree_size": mean("tree_size"), "width": mean("width"),
           "accepted_per_round": mean("accepted_per_round"), "theta": mean("theta"),
           "batch_size": mean("batch_size"), "queued": mean("queued", win),
           "queued_max": max((r["queued_max"] for r in win), default="")}
    log(f"{policy:>13} u={users:<3} run {run}: goodput {row['goodput_tok_s']:.1f} tok/s  tree {row['tree_size']}")
    return row


def warm_up(url: str, args, tag: str, tries: int = 3) -> list[dict]:
    """Before a fresh service's first measured cell: Locust at the highest level for
    ``args.warmup`` s (the measured path: same client, prompts and batch shapes), then
    idle; again (up to ``tries``, each twice as long as the one before: at the highest
    level one request may take longer than the first window) until a request has finished. Returns the finished
    requests' records. It keeps a new service's one-time costs (first batch shapes,
    first streams) out of its first cell, and fails loudly if the service answers
    nothing (the 0 tok/s first cells of one comparison were the runner's, fixed in
    ``serve_process``)."""
    users = max(args.levels)
    for i in range(1, tries + 1):
        name = f"warmup-{tag}-{i}"
        run_shape(url, f"const:{users}:{max(args.warmup, 5.0) * 2 ** (i - 1)}", args.out, name, args.load)
        wait_idle(url)
        ok = [r for r in read_records(args.out / "raw" / f"{name}-records.jsonl") if r.get("ok")]
        if ok:
            ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
            log(f"warm-up: {len(ok)} requests, TTFT max {max(ttft, default=float('nan')):.2f} s")
            return ok
        log(f"warm-up {i}: no request finished; again")
    raise RuntimeError(f"the service at {url} finished no request in {tries} warm-ups; see {args.out / 'raw'}")


def measure_cell(url: str, args, policy: str, users: int, run: int, stalls: list[dict]) -> dict:
    """``measure_run``, once more if no request finished in the window (a stall: its
    row goes to ``stalls``, written to ``compare-stalls.csv``, never into a median)."""
    row = measure_run(url, args, policy, users, run)
    if row["requests"] == 0:
        log(f"{policy} u={users} run {run}: no request finished in the window; measuring it again")
        stalls.append(row)
        write_csv(args.out / "compare-stalls.csv", stalls, COMPARE_FIELDS)
        row = measure_run(url, args, policy, users, run)
    return row


def compare_plan(levels, policies, runs: int) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """(run, variant, [(users, policy)]) in the order they happen: run by run, each
    variant's service once per run, its levels in order with every policy at one level
    before the next (the service drifts over a long comparison: a run measured last came
    out 10 % faster than the same policy measured first, so no policy may always go last)."""
    out = []
    for run in range(1, runs + 1):
        variants = list(dict.fromkeys(variant_of(p) for p in policies))
        if run % 2 == 0:
            variants.reverse()
        for v in variants:
            out.append((run, v, [(u, p) for u in levels for p in policies if variant_of(p) == v]))
    return out


def experiment_compare(url: str | None, args) -> Path:
    """``url``: one running service for every policy (overrides only); None: ``--config``
    started per variant and run (``compare_plan``)."""
    rows: list[dict] = []
    stalls: list[dict] = []
    for run, variant, cells in compare_plan(args.levels, args.policies, args.runs):
        with contextlib.ExitStack() as stack:
            u = url or stack.enter_context(serve_process(variant_config(args.config, variant, args.out),
                                                         args.out, args.port, args.ready_timeout))
            if url is None or not rows:
                warm_up(u, args, f"{variant}-r{run}")
            for users, policy in cells:
                rows.append(measure_cell(u, args, policy, users, run, stalls))
                write_csv(args.out / "compare.csv", rows, COMPARE_FIELDS)
            set_override(u, None)
    from loadtests.report import compare_detail, compare_table, plot_compare

    path = args.out / "compare.csv"
    plot_compare(path, args.out / "compare.png", title=args.title)
    table = compare_table(path)
    (args.out / "compare.md").write_text(table + "\n")
    (args.out / "compare-detail.md").write_text(compare_detail(path) + "\n")
    print(table)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.experiment", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=["ramp", "compare", "both"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="a Serve config to start with `serve run`")
    src.add_argument("--url", help="a running service, e.g. http://127.0.0.1:8000")
    p.add_argument("--port", type=int, help="rewrite the config's HTTP port")
    p.add_argument("--out", type=Path, default=Path("runs/load"))
    p.add_argument("--shape", default="ramp:1,2,4,8,16:30", help="ramp: a loadtests.shapes spec")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16], help="compare: users")
    p.add_argument("--policies", nargs="+", default=["adaptive", "chain", "tree", "off"], choices=POLICIES,
                   help="compare: policies; perstep, perstep-local, perstep-fit and ladder each start a service "
                        "variant of --config (chain*, tree*, off run on the ladder variant)")
    p.add_argument("--runs", type=int, default=1, help="compare: runs of every cell (median and spread)")
    p.add_argument("--duration", type=float, default=40.0, help="compare: measured seconds per run")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="compare: seconds before measuring, in every cell; also the length of the "
                        "warm-up run at the highest level after each service start")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--chat", action="store_true", help="chat completions (the chat template applied)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--title", default="")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.load = LoadArgs(args.max_tokens, args.temperature, not args.no_stream, chat=args.chat)
    variants = {variant_of(p) for p in args.policies} if args.experiment != "ramp" else set()
    if args.url and variants - {"config", "ladder"}:
        raise SystemExit("perstep / perstep-local / perstep-fit / ladder need --config (they start their own services)")
    if args.experiment in ("ramp", "both"):
        with contextlib.ExitStack() as stack:
            url = service_url(stack, args.url, args.config, args.out, args.port, args.ready_timeout)
            set_override(url, None)
            experiment_ramp(url, args)
    if args.experiment in ("compare", "both"):
        if args.url:
            wait_healthy(args.url.rstrip("/"), args.ready_timeout)
        experiment_compare(args.url.rstrip("/") if args.url else None, args)

if __name__ == "__main__":
    main()

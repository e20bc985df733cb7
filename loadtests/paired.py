"""Paired, interleaved A/B comparisons of budget policies on one running service.

One service (``--config``, the served per-step default, or ``--url``), one Locust process
per load level at constant users, and the policy switched underneath it through
``POST /v1/speculation/override``: a fixed budget pinned with ``fixed: true`` (verified as
is, the replica's per-step allocation paused), per-step by releasing the override; and
through ``POST /v1/speculation/pricing``: per-step priced on the cluster's load (the
controller's theta, the served default) or on each replica's own queue (``perstep-local``).
After each switch the runner waits until every replica has applied the budget (and the
price source), then ``--settle`` seconds, then measures a block: goodput is the cluster's
``generation_tokens`` counter over the block's seconds; the block's load, theta and tree
are means of ``GET /v1/speculation`` polled each second, its latencies those of the
requests that ended in it (Locust's per-request records). ``loadtests.pairstats`` has the
statistics.

Experiments (``--experiments``, in the order given):

* ``aa``       per-step against per-step at ``--aa-users``: the interval must contain 1;
* ``ramp``     at each of ``--levels``, a *screen*: ``--screen-pairs`` short pairs
               (``--screen-s`` blocks) of per-step against each fixed policy (``--fixed``),
               the policies in turn, the pairs' order ABBA across them; the best fixed
               policy is the one per-step gains least on (median over its pairs).
               Then ``--pairs`` pairs of ``--block-s`` blocks, per-step against that
               policy, A B B A ...;
* ``default-off``  per-step (the served default) against ``off`` at ``--aa-users``;
* ``cluster-local``  at each of ``--cluster-users``, per-step with the cluster's price (A)
               against per-step with each replica pricing its own queue (B), ``--pairs``
               pairs of ``--block-s`` blocks: what the controller's price adds.

A level's experiments share one Locust process: the ``--aa-users`` level first, then the
ramp's other levels, then the other ``--cluster-users`` levels.

Writes ``blocks.csv`` (every block, as measured) after each block, and ``paired.md``
(the tables, from ``blocks.csv``: ``python -m loadtests.paired report OUT`` rewrites it).

    python -m loadtests.paired run --config configs/load-default.yaml --out docs/load/paired
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import requests

from loadtests.common import (
    LoadArgs,
    get_status,
    locust_command,
    log,
    poll_until,
    service_url,
    start_group,
    wait_idle,
)
from loadtests.experiment import BASELINES, speculation_row
from loadtests.paired_report import NAN, Block, read_blocks, write_blocks, write_report
from loadtests.pairstats import A, B, abba_sides

PERSTEP = "perstep"     # the served default: no override, priced on the cluster's load
LOCAL = "perstep-local"  # per-step, each replica priced on its own queue
FIXED = [p for p in BASELINES if p != "adaptive"]




# -- the service ----------------------------------------------------------------------------


def set_policy(url: str, policy: str, timeout_s: float = 30.0, heartbeats_s: float = 0.6) -> None:
    """``policy`` pinned (a fixed budget, verified as is) or per-step (override released),
    priced on the cluster's load or (``perstep-local``) each replica's own; returns once
    every replica runs it: shows the price source, and reports the pinned budget or (per-step,
    whose budget may move with every heartbeat) has reported for ``heartbeats_s`` since the
    release (two 0.25 s heartbeats: one reply carries the release, the next report shows it).
    A service whose controller does not price (``controller.pricing: false``) refuses the
    cluster's price (409): per-step there is local only."""
    budget = None if policy in (PERSTEP, LOCAL) else BASELINES[policy]
    source = "local" if policy == LOCAL else "cluster"
    t_post = time.monotonic()
    if (get_status(url) or {}).get("price_source") != source:
        r = requests.post(f"{url}/v1/speculation/pricing", json={"cluster": source == "cluster"}, timeout=10)
        r.raise_for_status()
    r = requests.post(f"{url}/v1/speculation/override", json={"budget": budget, "fixed": budget is not None},
                      timeout=10)
    r.raise_for_status()

    def applied() -> bool:
        st = get_status(url)
        if not st or st.get("override") != budget or not st["replicas"] or st.get("price_source") != source:
            return False
        if any(rep.get("price_source") != source for rep in st["replicas"].values()):
            return False
        if budget is not None:
            return all(rep["applied_budget"] == budget for rep in st["replicas"].values())
        since = time.monotonic() - t_post
        return all(rep["applied_budget"] == rep["budget"] or since - rep["last_seen_s"] > heartbeats_s
                   for rep in st["replicas"].values())

    poll_until(applied, timeout_s, f"{policy} not applied by every replica", period_s=0.1)


MEANS = ("tree_size", "batch_size", "queued", "queued_max", "theta")   # what a block averages over its polls


def measure(url: str, seconds: float, poll_s: float = 1.0) -> tuple[float, float, float, dict[str, float]]:
    """(start unix time, seconds, generated tokens, ``MEANS`` over status polls every
    ``poll_s``) over the next ``seconds``."""
    st0 = get_status(url)
    t0 = time.time()
    rows = []
    while (left := t0 + seconds - time.time()) > 0:
        time.sleep(min(poll_s, left))
        if (st := get_status(url)) is not None:
            rows.append(speculation_row(st))
    st1 = get_status(url)
    t1 = time.time()
    if st0 is None or st1 is None:
        raise RuntimeError(f"{url}/v1/speculation did not answer")
    toks = st1["counters"]["generation_tokens"] - st0["counters"]["generation_tokens"]
    rows = rows or [speculation_row(st1)]
    return t0, t1 - t0, toks, {k: float(np.mean([r[k] for r in rows])) for k in MEANS}


def read_records_so_far(path: Path) -> list[dict]:
    """The per-request records Locust has written to ``path`` so far (a line still being
    written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def block_latency(records: list[dict], start: float, end: float) -> tuple[int, float, float]:
    """(requests, p90 end-to-end seconds, p90 time to first token) of the successful
    requests that ended in ``[start, end)`` (unix seconds); nan where none did."""
    done = [r for r in records if r.get("ok") and start <= r["t1"] < end]
    e2e = [r["t1"] - r["t0"] for r in done]
    ttft = [r["ttft"] for r in done if r.get("ttft") is not None]
    return (len(done), float(np.percentile(e2e, 90)) if e2e else NAN,
            float(np.percentile(ttft, 90)) if ttft else NAN)


@contextlib.contextmanager
def locust_running(url: str, users: int, out: Path, name: str, load: LoadArgs, warm_s: float) -> Iterator[None]:
    """Locust at ``users`` constant users in its own process group, ``warm_s`` after its
    start; stopped with SIGINT when the block sequence ends."""
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prefix = raw / name
    Path(f"{prefix}-records.jsonl").unlink(missing_ok=True)
    with open(raw / f"{name}-locust.log", "w") as logf:
        proc = start_group(locust_command(url, f"const:{users}:86400", prefix, load), logf)
        try:
            time.sleep(warm_s)
            if proc.poll() is not None:
                raise RuntimeError(f"locust exited with {proc.returncode}; see {raw / f'{name}-locust.log'}")
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Runner:
    """Blocks measured on one service, each appended to ``blocks.csv`` at once."""

    def __init__(self, url: str, args) -> None:
        self.url, self.args = url, args
        self.blocks: list[Block] = read_blocks(args.out / "blocks.csv") if args.resume else []
        self.records: Path | None = None    # the running level's per-request records

    def block(self, experiment: str, users: int, pair: int, side: str, policy: str, seconds: float) -> Block:
        set_policy(self.url, policy)
        time.sleep(self.args.settle)
        t0, secs, toks, m = measure(self.url, seconds)
        n, e2e, ttft = block_latency(read_records_so_far(self.records) if self.records else [], t0, t0 + secs)
        b = Block(experiment, users, pair, side, policy, t0, secs, toks, toks / secs, m["tree_size"],
                  m["batch_size"], m["queued"], m["queued_max"], m["theta"], n, e2e, ttft)
        self.blocks.append(b)
        write_blocks(self.args.out / "blocks.csv", self.blocks)
        log(f"{experiment} u={users} pair {pair} {side} {policy:>13}: {b.goodput_tok_s:6.1f} tok/s, "
            f"tree {b.tree_size:.2f}, batch {b.batch_size:.1f}, theta {b.theta:.2f}, queued {b.queued:.1f}, "
            f"p90 e2e {b.e2e_p90_s:.2f} s ({n} requests)")
        return b

    def pairs(self, experiment: str, users: int, a: str, b: str, n: int, seconds: float) -> None:
        for i, side in enumerate(abba_sides(n)):
            self.block(experiment, users, i // 2, side, a if side == A else b, seconds)

    def screen(self, users: int) -> str:
        """``--screen-pairs`` pairs per fixed policy, the policies in turn, ABBA across them;
        the fixed policy per-step gains least on (median over its pairs) is the best fixed
        one, measured next to per-step."""
        ratios: dict[str, list[float]] = {p: [] for p in self.args.fixed}
        i = 0
        for _ in range(self.args.screen_pairs):
            for policy in self.args.fixed:
                sides = (A, B) if i % 2 == 0 else (B, A)
                got = {s: self.block("screen", users, i, s, PERSTEP if s == A else policy, self.args.screen_s)
                       for s in sides}
                ratios[policy].append(got[A].goodput_tok_s / max(got[B].goodput_tok_s, 1e-9))
                i += 1
        med = {p: float(np.median(r)) for p, r in ratios.items()}
        best = min(med, key=med.get)
        log(f"u={users}: best fixed {best} (per-step / fixed: "
            + ", ".join(f"{p} {r:.2f}" for p, r in med.items()) + ")")
        return best

    def level(self, users: int, experiments: list[str]) -> None:
        warm = self.args.level_warm * (1 if self.blocks else 2)   # a fresh service's first requests are slow
        self.records = self.args.out / "raw" / f"u{users}-records.jsonl"
        with locust_running(self.url, users, self.args.out, f"u{users}", self.args.load, warm):
            if "aa" in experiments:
                self.pairs("aa", users, PERSTEP, PERSTEP, self.args.pairs, self.args.block_s)
            if "ramp" in experiments:
                best = self.screen(users)
                self.pairs("paired", users, PERSTEP, best, self.args.pairs, self.args.block_s)
            if "default-off" in experiments:
                self.pairs("default-off", users, PERSTEP, "off", self.args.pairs, self.args.block_s)
            if "cluster-local" in experiments:
                self.pairs("cluster-local", users, PERSTEP, LOCAL, self.args.pairs, self.args.block_s)
        set_policy(self.url, PERSTEP)
        wait_idle(self.url, 120)


def plan(args) -> list[tuple[int, list[str]]]:
    """(users, experiments at that level) in run order: the ``--aa-users`` level first
    (A/A, its ramp level, default vs off, and cluster-local if it is one of
    ``--cluster-users``), then the ramp's other levels in ``--levels`` order, then the other
    ``--cluster-users`` levels."""
    ex = args.experiments
    levels: dict[int, list[str]] = {}    # in insertion order: the run's
    for e in ("aa", "ramp", "default-off"):
        if e in ex and (e != "ramp" or args.aa_users in args.levels):
            levels.setdefault(args.aa_users, []).append(e)
    if "ramp" in ex:
        for u in (u for u in args.levels if u != args.aa_users):
            levels.setdefault(u, []).append("ramp")
    if "cluster-local" in ex:
        for u in args.cluster_users:
            levels.setdefault(u, []).append("cluster-local")
    return list(levels.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.paired", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="measure (writes blocks.csv and paired.md)")
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="a Serve config to start with `serve run`")
    src.add_argument("--url", help="a running service, e.g. http://127.0.0.1:8000")
    run.add_argument("--port", type=int, help="rewrite the config's HTTP port")
    run.add_argument("--out", type=Path, default=Path("runs/paired"))
    run.add_argument("--experiments", nargs="+", default=["aa", "ramp", "default-off"],
                     choices=["aa", "ramp", "default-off", "cluster-local"])
    run.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="ramp: users")
    run.add_argument("--aa-users", type=int, default=8, help="users of the A/A and default-off runs")
    run.add_argument("--cluster-users", type=int, nargs="+", default=[8, 16], help="cluster-local: users")
    run.add_argument("--fixed", nargs="+", default=FIXED, choices=FIXED, help="ramp: the fixed policies screened")
    run.add_argument("--pairs", type=int, default=5)
    run.add_argument("--block-s", type=float, default=15.0, help="seconds of a measured block")
    run.add_argument("--screen-s", type=float, default=10.0, help="seconds of a screen block")
    run.add_argument("--screen-pairs", type=int, default=1, help="screen pairs per fixed policy and level")
    run.add_argument("--settle", type=float, default=3.0, help="seconds after a switch before measuring")
    run.add_argument("--level-warm", type=float, default=15.0, help="seconds of load before a level's first block")
    run.add_argument("--resume", action="store_true", help="keep the blocks already in OUT/blocks.csv")
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--seed", type=int, default=0, help="the bootstrap's numpy seed")
    run.add_argument("--ready-timeout", type=float, default=300.0)
    rep = sub.add_parser("report", help="rewrite OUT/paired.md from OUT/blocks.csv")
    rep.add_argument("out", type=Path)
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--command", default="", help="the command line the blocks came from (the report's first line)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.cmd == "report":
        print(write_report(args.out, args.command or f"python -m loadtests.paired report {args.out}", args.seed))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    args.load = LoadArgs(args.max_tokens, 0.0, True, chat=True)
    command = "python -m loadtests.paired " + " ".join(sys.argv[1:] if argv is None else argv)
    with contextlib.ExitStack() as stack:
        url = service_url(stack, args.url, args.config, args.out, args.port, args.ready_timeout)
        runner = Runner(url, args)
        try:
            for users, experiments in plan(args):
                runner.level(users, experiments)
                write_report(args.out, command, args.seed)
        finally:
            for path, body in (("override", {"budget": None}), ("pricing", {"cluster": True})):
                with contextlib.suppress(requests.RequestException):
                    requests.post(f"{url}/v1/speculation/{path}", json=body, timeout=10)
    print(write_report(args.out, command, args.seed))


if __name__ == "__main__":
    main()

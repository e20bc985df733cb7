"""A discrete-event serving simulator: replicas x arrival rate x speculation policy.

Driven by two measured things, so its answers are about this hardware and this pair:

* the cost model ``T(bs, k)`` (``treespark cost-model``): one engine step of ``bs`` rows
  verifying ``k`` tokens each takes ``T(bs, k)``, plus one prefill chunk when a request
  joins (``T(1, prompt_tokens)``, the engine prefills one chunk per step);
* per-round traces (``loadtests.traces``): for each tree size ``n``, the draft tokens the
  target accepted in real rounds (``record``: the engine on held-out prompts under
  several budgets).

Requests arrive as a Poisson process (``rate`` per second), go to the replica with the
fewest requests (or in turn, ``routing``), on replicas of equal or given speeds
(``slowdown``), wait for a batch row (``max_batch``), and emit ``1 + accepted`` tokens
per step until ``max_tokens`` (a step: T(bs, n + 1) plus ``draft_node_s`` per draft
node). Every step, the policy prices the replica from the
cluster snapshot exactly as the controller would (the same ``BudgetPolicy`` objects;
the adaptive policy also learns acceptance from the simulated rounds). A tree is
simulated at its budget's ``node_cap`` (theta's early stopping inside a round is not
modelled), with its accepted length drawn from the traces of that size.

    python -m loadtests.simulate record --pair default --out docs/load/simulation/traces.json
    python -m loadtests.simulate run --cost configs/costmodel-smollm2.json \\
        --traces docs/load/simulation/traces.json --out docs/load/simulation/simulation.md
    python -m loadtests.simulate run --cost docs/load/simulation/costmodel-illustrative-gpu.json --max-batch 64 \\
        --rates 1 4 16 64 --out docs/load/simulation/simulation-gpu-shaped.md

``perstep`` is the per-step policy (``PerStepSim``): the controller's theta, then each
step's plan on the cost table, as the engines run it.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.common import percentile
from loadtests.traces import Traces, record_traces
from treespark.pricing.allocate import StepCosts, plan_drafting
from treespark.pricing.costmodel import AcceptanceProfile, CostModel, step_time
from treespark.pricing.estimators import RoundWindow
from treespark.pricing.policy import (
    BudgetPolicy,
    CostModelPolicy,
    FixedPolicy,
    LoadSnapshot,
    PerStepPolicy,
)
from treespark.spec.budget import Budget

THETA_FROM = ("cluster", "local", "max")


@dataclass
class PerStepSim:
    """The per-step policy in the simulator: the theta from ``PerStepPolicy`` (what the
    controller sets), then each step the engine's plan (``plan_drafting``) over rows whose
    n-th best node scores ``A(n) - A(n - 1)`` (the acceptance profile's marginal, learned
    from the simulated rounds like the cost-model policy's), on ``costs``."""

    costs: StepCosts
    prior: AcceptanceProfile
    theta_policy: PerStepPolicy
    prior_weight: float = 200.0
    theta_from: str = "cluster"   # "cluster": the controller's; "local": the replica's own queue; "max": both

    def __post_init__(self) -> None:
        if self.theta_from not in THETA_FROM:
            raise ValueError(f"theta_from must be one of {THETA_FROM}, got {self.theta_from!r}")

    def budget_for(self, load: LoadSnapshot, replica_id: str = "") -> Budget:
        return self.theta_policy.budget_for(load, replica_id)

    def theta(self, load: LoadSnapshot, local: LoadSnapshot) -> float:
        """The step's price theta from the cluster's load, the replica's own, or the higher."""
        cluster = self.theta_policy.theta(load) if self.theta_from != "local" else 0.0
        own = self.theta_policy.theta(local) if self.theta_from != "cluster" else 0.0
        return max(cluster, own)

    def step_budget(self, load: LoadSnapshot, rows: int, theta: float) -> Budget:
        """The step's drafting budget under ``theta`` (``theta(load, local)``)."""
        a = AcceptanceProfile.blend(self.prior, load.acceptance, self.prior_weight)
        n = min(self.theta_policy.max_nodes, a.max_nodes)
        marg = [max(a(i) - a(i - 1), 0.0) for i in range(1, n + 1)]
        plan = plan_drafting([marg] * max(rows, 1), self.costs, theta=theta)
        return Budget(theta, plan.pad, self.theta_policy.max_branch) if plan.pad else Budget.off()


# -- the simulation -------------------------------------------------------------------------


@dataclass
class _Req:
    arrival: float
    remaining: int
    first_token: float | None = None


@dataclass
class _Replica:
    rid: str
    busy_until: float = 0.0
    running: list[_Req] = field(default_factory=list)
    queue: deque = field(default_factory=deque)


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 1
    rate: float = 1.0            # requests per second (Poisson)
    max_batch: int = 16
    max_tokens: int = 64
    prompt_tokens: int = 48
    duration_s: float = 300.0
    warmup_s: float = 30.0
    draft_node_s: float = 0.0    # drafting seconds per draft node, added to each step
    seed: int = 0
    slowdown: tuple[float, ...] = ()   # replica i's steps take slowdown[i] x the cost model (default 1)
    routing: str = "least"             # "least": fewest requests (running + waiting); "round-robin"


@dataclass(frozen=True)
class SimResult:
    goodput_tok_s: float
    requests: int
    p50_latency_s: float
    p99_latency_s: float
    p50_ttft_s: float
    mean_tree_size: float
    mean_batch: float
    tokens_per_round: float
    mean_queued: tuple[float, ...] = ()   # per replica, over its steps: requests waiting beyond its batch
    mean_theta: float = 0.0               # per-step policies: the price theta, over all steps


def simulate(policy: BudgetPolicy, cost: CostModel, traces: Traces, cfg: SimConfig) -> SimResult:
    """Runs the cluster for ``cfg.duration_s`` simulated seconds; measures after warm-up."""
    rng = random.Random(cfg.seed)              # acceptance draws
    arrivals = random.Random(cfg.seed + 1)     # the same arrivals for every policy
    reps = [_Replica(f"r{i}") for i in range(cfg.replicas)]
    window = RoundWindow(maxlen=5000)
    learn = isinstance(policy, (CostModelPolicy, PerStepSim))
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, replica)
    seq = 0

    def push(t: float, kind: str, i: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, i))
        seq += 1

    push(arrivals.expovariate(cfg.rate), "arrive", -1)
    tokens = arrived = 0
    lat, ttft, trees, batches, emitted_rounds, thetas = [], [], [], [], [], []
    queued: list[list[int]] = [[] for _ in reps]
    slow = [cfg.slowdown[j] if j < len(cfg.slowdown) else 1.0 for j in range(len(reps))]
    while events:
        now, _, kind, i = heapq.heappop(events)
        if now > cfg.duration_s:
            break
        if kind == "arrive":
            if cfg.routing == "round-robin":
                r = reps[arrived % len(reps)]
            else:
                r = min(reps, key=lambda x: len(x.running) + len(x.queue))
            arrived += 1
            r.queue.append(_Req(now, cfg.max_tokens))
            if r.busy_until <= now:
                push(now, "step", reps.index(r))
            push(now + arrivals.expovariate(cfg.rate), "arrive", -1)
            continue
        r = reps[i]
        if r.busy_until > now + 1e-12 or (not r.running and not r.queue):
            continue
        load = LoadSnapshot(replicas=len(reps), active=sum(len(x.running) for x in reps),
                            queued=sum(len(x.queue) for x in reps),
                            acceptance=window.stats() if learn else None, draft_node_s=cfg.draft_node_s)
        if isinstance(policy, PerStepSim):
            theta = policy.theta(load, LoadSnapshot(replicas=1, active=len(r.running), queued=len(r.queue)))
            budget = policy.step_budget(load, len(r.running), theta)
            if now >= cfg.warmup_s:
                thetas.append(theta)
        else:
            budget = policy.budget_for(load, r.rid)
        n = 0 if budget.is_off else budget.node_cap
        dt = 0.0
        joined: _Req | None = None
        if r.queue and len(r.running) < cfg.max_batch:  # one prefill chunk per step
            joined = r.queue.popleft()
            dt += cost.time(1, cfg.prompt_tokens)
        if r.running:
            dt += step_time(cost, len(r.running), n + 1, cfg.draft_node_s)
        dt *= slow[i]
        if now >= cfg.warmup_s:
            queued[i].append(len(r.queue))
        end = now + dt
        done: list[_Req] = []
        rounds = []
        for q in r.running:
            a = min(traces.sample(n, rng), n)
            rounds.append((n, a))
            out = min(1 + a, q.remaining)
            q.remaining -= out
            if q.first_token is None:
                q.first_token = end
            if end >= cfg.warmup_s:
                tokens += out
            if q.remaining <= 0:
                done.append(q)
        window.extend(rounds)
        if end >= cfg.warmup_s and r.running:
            trees.append(n)
            batches.append(len(r.running))
            emitted_rounds.extend(1 + a for _, a in rounds)
        for q in done:
            r.running.remove(q)
            if q.arrival >= cfg.warmup_s:
                lat.append(end - q.arrival)
                ttft.append(q.first_token - q.arrival)
        if joined is not None:  # prefill emits the first token
            joined.remaining -= 1
            joined.first_token = end
            if end >= cfg.warmup_s:
                tokens += 1
            r.running.append(joined)
        r.busy_until = end
        if r.running or r.queue:
            push(end, "step", i)
    span = cfg.duration_s - cfg.warmup_s
    return SimResult(tokens / span, len(lat), percentile(lat, 0.5), percentile(lat, 0.99), percentile(ttft, 0.5),
                     sum(trees) / len(trees) if trees else 0.0, sum(batches) / len(batches) if batches else 0.0,
                     sum(emitted_rounds) / len(emitted_rounds) if emitted_rounds else 0.0,
                     tuple(sum(q) / len(q) if q else 0.0 for q in queued),
                     sum(thetas) / len(thetas) if thetas else 0.0)


def per_step_sim(cost: CostModel, max_batch: int, prior: AcceptanceProfile, draft_node_s: float = 0.0,
                 theta_from: str = "cluster") -> PerStepSim:
    """The per-step policy as the replicas run it (32 nodes, 4 wide), its theta from ``theta_from``."""
    draft = CostModel.affine(0.0, draft_node_s) if draft_node_s > 0 else None    # per row and node of cap
    return PerStepSim(StepCosts(cost, max_nodes=32, draft=draft), prior,
                      PerStepPolicy(max_nodes=32, max_branch=4, max_batch=max_batch), theta_from=theta_from)


def baseline_policies(cost: CostModel, max_batch: int, prior: AcceptanceProfile,
                      draft_node_s: float = 0.0) -> dict[str, BudgetPolicy]:
    return {
        "perstep": per_step_sim(cost, max_batch, prior, draft_node_s),
        "adaptive": CostModelPolicy(cost, prior, max_batch=max_batch),
        "chain": FixedPolicy(Budget.chain(4)),
        "tree": FixedPolicy(Budget(0.02, 32, 4)),
        "off": FixedPolicy(Budget.off()),
    }


def theta_policies(cost: CostModel, max_batch: int, prior: AcceptanceProfile,
                   draft_node_s: float = 0.0) -> dict[str, BudgetPolicy]:
    """The per-step policy with its theta from the cluster's load (the controller's), from
    each replica's own (local only), and the higher of the two; and plain decoding."""
    pols: dict[str, BudgetPolicy] = {f"perstep-{src}": per_step_sim(cost, max_batch, prior, draft_node_s, src)
                                     for src in THETA_FROM}
    return {**pols, "off": FixedPolicy(Budget.off())}


def sweep(cost: CostModel, traces: Traces, replicas: list[int], rates: list[float], base: SimConfig,
          prior: AcceptanceProfile, log=print, policies=baseline_policies) -> list[dict]:
    """Every (replicas, rate) cell of ``base`` under each of ``policies(cost, max_batch,
    prior, draft_node_s)``. With ``base.slowdown`` and ``theta_policies``: replicas of
    unequal speed, where a slow one queues while the others do not, and what each source
    of the theta makes of that."""
    rows = []
    for nrep in replicas:
        for rate in rates:
            cfg = SimConfig(**{**base.__dict__, "replicas": nrep, "rate": rate})
            for name, pol in policies(cost, cfg.max_batch, prior, cfg.draft_node_s).items():
                res = simulate(pol, cost, traces, cfg)
                rows.append({"replicas": nrep, "rate": rate, "policy": name, **res.__dict__})
                log(f"replicas={nrep} rate={rate:g}/s {name:>16}: {res.goodput_tok_s:7.1f} tok/s "
                    f"p50 {res.p50_latency_s:6.2f} s p99 {res.p99_latency_s:6.2f} s tree {res.mean_tree_size:5.1f} "
                    f"batch {res.mean_batch:4.1f} waiting {[round(q, 1) for q in res.mean_queued]} "
                    f"theta {res.mean_theta:.2f}")
    return rows


def imbalance_table(rows: list[dict]) -> str:
    head = ["rate req/s", "policy", "goodput tok/s", "p50 s", "p99 s", "waiting per replica (mean)",
            "theta (mean)", "tree (mean)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            f"{r['rate']:g}", r["policy"], f"{r['goodput_tok_s']:.1f}", f"{r['p50_latency_s']:.2f}",
            f"{r['p99_latency_s']:.2f}", " / ".join(f"{q:.1f}" for q in r["mean_queued"]),
            f"{r['mean_theta']:.2f}", f"{r['mean_tree_size']:.1f}"]) + " |")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    head = ["replicas", "rate req/s"] + [f"{p} tok/s (p50 s, tree)" for p in pols] + \
        ["perstep / best other goodput", "perstep / best other p50 latency"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["replicas"], r["rate"]) for r in rows))
    for k in keys:
        g = {r["policy"]: r for r in rows if (r["replicas"], r["rate"]) == k}
        cells = [str(k[0]), f"{k[1]:g}"]
        cells += [f"{g[p]['goodput_tok_s']:.1f} ({g[p]['p50_latency_s']:.1f}, {g[p]['mean_tree_size']:.1f})" for p in pols]
        best = max(g[p]["goodput_tok_s"] for p in pols if p != "perstep")
        fast = min(g[p]["p50_latency_s"] for p in pols if p != "perstep")
        cells.append(f"{g['perstep']['goodput_tok_s'] / best:.2f}" if "perstep" in g and best else "-")
        cells.append(f"{g['perstep']['p50_latency_s'] / fast:.2f}" if "perstep" in g and fast else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtests.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record per-round traces with the engine")
    r.add_argument("--pair", default="default", choices=["default", "random"])
    r.add_argument("--prompts", type=int, default=8)
    r.add_argument("--max-tokens", type=int, default=48)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("run", help="sweep replicas x arrival rate x policy")
    s.add_argument("--cost", type=Path, required=True)
    s.add_argument("--traces", default="synthetic", help="a traces JSON, or 'synthetic'")
    s.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    s.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0])
    s.add_argument("--max-batch", type=int, default=16)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--duration", type=float, default=600.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--draft-node-s", type=float, default=0.0, help="drafting seconds per draft node")
    s.add_argument("--out", type=Path, help="markdown table (and a .csv beside it)")
    s.add_argument("--routing", default="least", choices=["least", "round-robin"],
                   help="least: to the replica with the fewest requests; round-robin: in turn")
    s.add_argument("--slowdown", type=float, nargs="+",
                   help="one factor per replica (their count): replica i's steps take that many times the cost "
                        "model; runs the per-step theta from the cluster, local and max, and off, at --rates")
    args = p.parse_args(argv)
    if args.cmd == "record":
        from treespark.models.pair import pair_by_name

        budgets = [Budget.chain(k) for k in (1, 2, 4)] + [Budget(0.0, n, 4) for n in (2, 4, 8, 16, 32)]
        traces = record_traces(pair_by_name(args.pair), budgets, args.prompts, args.max_tokens, args.batch_size,
                               log=lambda m: print(m, file=sys.stderr))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        traces.save(args.out)
        print({n: round(traces.mean(n), 2) for n in traces.sizes()})
        return
    cost = CostModel.load(args.cost)
    prior = AcceptanceProfile.saturating()
    traces = Traces.synthetic(prior) if args.traces == "synthetic" else Traces.load(Path(args.traces))
    base = SimConfig(max_batch=args.max_batch, max_tokens=args.max_tokens, duration_s=args.duration,
                     warmup_s=min(60.0, args.duration / 5), seed=args.seed, draft_node_s=args.draft_node_s,
                     routing=args.routing)
    if args.slowdown:
        base = SimConfig(**{**base.__dict__, "slowdown": tuple(args.slowdown)})
        rows = sweep(cost, traces, [len(args.slowdown)], args.rates, base, prior,
                     log=lambda m: print(m, file=sys.stderr), policies=theta_policies)
        table = imbalance_table(rows)
    else:
        rows = sweep(cost, traces, args.replicas, args.rates, base, prior, log=lambda m: print(m, file=sys.stderr))
        table = sweep_table(rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
        import csv

        with args.out.with_suffix(".csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()

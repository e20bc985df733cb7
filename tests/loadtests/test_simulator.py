"""The serving simulator: traces, events, and the policies under simulated load."""

import random

import pytest

from loadtests.simulate import SimConfig, baseline_policies, simulate, sweep, sweep_table
from loadtests.traces import Traces
from treespark.pricing.costmodel import AcceptanceProfile, CostModel
from treespark.pricing.policy import FixedPolicy
from treespark.spec.budget import Budget

COST = CostModel.affine(0.08, 0.002)
PRIOR = AcceptanceProfile.saturating(max_nodes=32)
TRACES = Traces.synthetic(PRIOR, rounds=200)


def test_traces_sample_and_round_trip(tmp_path):
    t = Traces({2: (0, 1, 2), 8: (3,)})
    rng = random.Random(0)
    assert t.sample(0, rng) == 0 and t.sample(1, rng) == 0   # nothing recorded below 2
    assert t.sample(5, rng) in (0, 1, 2) and t.sample(64, rng) == 3
    t.save(tmp_path / "t.json")
    assert Traces.load(tmp_path / "t.json").by_size == t.by_size
    assert abs(TRACES.mean(16) - PRIOR(16)) < 0.2


def test_light_load_is_arrival_bound_and_trees_are_big():
    cfg = SimConfig(rate=0.2, duration_s=200, warmup_s=20, max_tokens=32)
    res = {k: simulate(p, COST, TRACES, cfg) for k, p in baseline_policies(COST, 16, PRIOR).items()}
    assert res["adaptive"].mean_tree_size >= 8
    offered = cfg.rate * cfg.max_tokens
    for r in res.values():
        assert r.goodput_tok_s == pytest.approx(offered, rel=0.35)
    assert res["adaptive"].p50_latency_s < res["off"].p50_latency_s


def test_overload_adaptive_turns_off_and_keeps_up_with_plain():
    cfg = SimConfig(rate=20.0, duration_s=60, warmup_s=10, max_tokens=32)
    ada = simulate(baseline_policies(COST, 16, PRIOR)["adaptive"], COST, TRACES, cfg)
    off = simulate(FixedPolicy(Budget.off()), COST, TRACES, cfg)
    tree = simulate(FixedPolicy(Budget(0.0, 32, 4)), COST, TRACES, cfg)
    assert ada.mean_batch > 12 and ada.mean_tree_size < 2
    assert ada.goodput_tok_s >= 0.97 * off.goodput_tok_s
    assert ada.goodput_tok_s > tree.goodput_tok_s


def test_sweep_table():
    base = SimConfig(duration_s=40, warmup_s=5, max_tokens=16)
    rows = sweep(COST, TRACES, [1, 2], [1.0], base, PRIOR, log=lambda m: None)
    assert len(rows) == 10 and {r["policy"] for r in rows} == {"perstep", "adaptive", "chain", "tree", "off"}
    table = sweep_table(rows)
    assert table.count("\n") == 3 and "perstep / best other" in table


def test_the_per_step_policy_grows_trees_light_and_goes_plain_in_overload():
    pols = baseline_policies(COST, 16, PRIOR, draft_node_s=0.00015)
    light = simulate(pols["perstep"], COST, TRACES, SimConfig(rate=0.2, duration_s=200, warmup_s=20, max_tokens=32))
    assert light.mean_tree_size >= 4
    cfg = SimConfig(rate=20.0, duration_s=60, warmup_s=10, max_tokens=32)
    heavy = simulate(pols["perstep"], COST, TRACES, cfg)
    off = simulate(FixedPolicy(Budget.off()), COST, TRACES, cfg)
    assert heavy.mean_tree_size < 1 and heavy.goodput_tok_s >= 0.97 * off.goodput_tok_s


def test_the_floor_comes_from_the_cluster_the_replica_or_the_higher():
    from loadtests.simulate import PerStepSim
    from treespark.pricing.allocate import StepCosts
    from treespark.pricing.policy import LoadSnapshot, PerStepPolicy

    def sim(src):
        return PerStepSim(StepCosts(COST), PRIOR, PerStepPolicy(max_batch=16), theta_from=src)

    # 8 waiting on this replica, none on the other: the cluster's average hides it
    cluster, own = LoadSnapshot(replicas=2, active=24, queued=8), LoadSnapshot(replicas=1, active=16, queued=8)
    assert sim("cluster").theta(cluster, own) == 0.0
    assert sim("local").theta(cluster, own) == pytest.approx(1 / 3)   # p = 8 / 16, theta p / (1 + p)
    assert sim("max").theta(cluster, own) == sim("local").theta(cluster, own)
    with pytest.raises(ValueError, match="theta_from"):
        sim("mean")


def test_a_slow_replica_queues_alone_under_round_robin_and_not_when_routed_to_the_least_loaded():
    base = SimConfig(replicas=2, rate=4.0, duration_s=120, warmup_s=20, max_tokens=32, slowdown=(1.0, 3.0))
    off = FixedPolicy(Budget.off())
    rr = simulate(off, COST, TRACES, SimConfig(**{**base.__dict__, "routing": "round-robin"}))
    least = simulate(off, COST, TRACES, base)
    assert rr.mean_queued[1] > 5 * max(rr.mean_queued[0], 0.1)
    assert max(least.mean_queued) < rr.mean_queued[1] / 2
    assert least.goodput_tok_s > rr.goodput_tok_s

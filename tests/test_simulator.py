"""The serving simulator: traces, events, and the policies under simulated load."""

import random

import pytest

from loadtests.simulate import SimConfig, Traces, baseline_policies, simulate, sweep, sweep_table
from treespark.budget import Budget
from treespark.pricing.costmodel import AcceptanceProfile, CostModel
from treespark.pricing.policy import FixedPolicy

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

"""The speculation ladder: monotone in load, configurable, validated."""

import math

import pytest

from treespark.pricing.policy import BudgetPolicy, FixedPolicy, LadderPolicy, LoadSnapshot, Rung
from treespark.spec.budget import Budget


def _loads():
    for replicas in (1, 2, 3, 8):
        for active in range(0, 80, 3):
            for queued in (0, 1, 5, 40):
                yield LoadSnapshot(replicas=replicas, active=active, queued=queued)


def test_default_ladder_spans_tree_to_off():
    p = LadderPolicy()
    light = p.budget_for(LoadSnapshot(replicas=1, active=1, queued=0), "r")
    heavy = p.budget_for(LoadSnapshot(replicas=1, active=10, queued=0), "r")
    flooded = p.budget_for(LoadSnapshot(replicas=1, active=64, queued=64), "r")
    medium = p.budget_for(LoadSnapshot(replicas=1, active=4, queued=0), "r")
    assert light.kind == "tree" and light.branch_cap > medium.branch_cap
    assert medium.kind == "tree"
    assert heavy.kind == "chain"
    assert flooded.kind == "off"
    assert LoadSnapshot.idle().load_per_replica == 0
    assert p.budget_for(LoadSnapshot.idle(), "r") == light


def test_monotone_in_load():
    p = LadderPolicy()
    pts = sorted(_loads(), key=lambda s: s.load_per_replica)
    budgets = [p.budget_for(s, "r") for s in pts]
    for a, b in zip(budgets, budgets[1:], strict=False):
        assert b.theta >= a.theta
        assert b.node_cap <= a.node_cap
        assert b.branch_cap <= a.branch_cap


def test_load_is_per_replica():
    p = LadderPolicy()
    one = p.budget_for(LoadSnapshot(replicas=1, active=8, queued=0), "r")
    two = p.budget_for(LoadSnapshot(replicas=2, active=8, queued=0), "r")
    assert two.node_cap >= one.node_cap and two.theta <= one.theta


def test_thresholds_configurable_and_boundaries_inclusive():
    p = LadderPolicy.from_thresholds([1, 4], [Budget.adaptive(0.01), Budget(0.3, 4, 1), Budget(1.0, 0, 1)])
    assert p.budget_for(LoadSnapshot(1, 1, 0), "r").kind == "tree"
    assert p.budget_for(LoadSnapshot(1, 2, 0), "r").kind == "chain"
    assert p.budget_for(LoadSnapshot(1, 4, 0), "r").kind == "chain"
    assert p.budget_for(LoadSnapshot(1, 5, 0), "r").is_off
    assert p.rungs[-1].max_load == math.inf


@pytest.mark.parametrize(
    "rungs",
    [
        (),
        (Rung(4, Budget(0.5, 4, 1)), Rung(8, Budget(0.1, 4, 1))),  # theta falls
        (Rung(4, Budget(0.1, 4, 1)), Rung(8, Budget(0.2, 8, 1))),  # node_cap grows
        (Rung(4, Budget(0.1, 4, 1)), Rung(8, Budget(0.2, 4, 2))),  # branch_cap grows
        (Rung(4, Budget(0.1, 4, 1)), Rung(4, Budget(0.2, 4, 1))),  # max_load not increasing
    ],
)
def test_rejects_non_monotone_ladders(rungs):
    with pytest.raises(ValueError):
        LadderPolicy(rungs)


def test_from_thresholds_length_mismatch():
    with pytest.raises(ValueError):
        LadderPolicy.from_thresholds([1, 2], [Budget.off()])


@pytest.mark.parametrize("kw", [dict(replicas=-1), dict(active=1.5), dict(queued=-2)])
def test_snapshot_validates(kw):
    base = dict(replicas=1, active=0, queued=0)
    with pytest.raises(ValueError):
        LoadSnapshot(**{**base, **kw})


def test_protocol():
    assert isinstance(LadderPolicy(), BudgetPolicy)
    assert isinstance(FixedPolicy(Budget.chain(4)), BudgetPolicy)
    assert FixedPolicy(Budget.chain(4)).budget_for(LoadSnapshot(1, 99, 9), "x") == Budget.chain(4)

"""The controller's state without Ray: load aggregation, budgets, registration, the online refit."""



from deployments.config import AppArgs
from deployments.controller.state import ControllerState, aggregate_load, assign_budgets, expired
from deployments.reports import ReplicaReport, TreeStats
from treespark.pricing.policy import LadderPolicy, LoadSnapshot
from treespark.spec.budget import Budget


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def rep(rid, active=0, queued=0, steps=0, step_s=0.0, counters=None, records=()):
    return ReplicaReport(rid, active, queued, 10.0, TreeStats(steps=steps, step_s=step_s), {"theta": 0.0, "node_cap": 0, "branch_cap": 1},
                         "local", counters or {}, tuple(records))


def test_aggregate_and_assign():
    load = aggregate_load([rep("a", 3, 1, steps=2, step_s=0.1), rep("b", 5, 0), rep("c", 0, 0, steps=1, step_s=0.3)])
    assert (load.replicas, load.active, load.queued) == (3, 8, 1)
    p = LadderPolicy()
    assert assign_budgets(p, load, ["a", "b"]) == {"a": p.budget_for(load, "a"), "b": p.budget_for(load, "b")}
    assert set(assign_budgets(p, load, ["a"], override=Budget.chain(3)).values()) == {Budget.chain(3)}
    assert expired({"a": 0.0, "b": 1.5}, now=2.5, timeout_s=2.0) == ["a"]


def test_controller_registers_prices_and_drops():
    clock = Clock()
    s = ControllerState(LadderPolicy(), heartbeat_timeout_s=2.0, clock=clock)
    r = s.report(rep("a"))
    assert r["registered"] and r["budget"]["branch_cap"] == 4  # idle: wide tree
    assert not s.report(rep("a"))["registered"]
    # load rises: both replicas get the heavier budget at once
    s.report(rep("b", active=20, counters={"requests": 5}))
    assert s.replicas["a"].budget == s.replicas["b"].budget == LadderPolicy().budget_for(LoadSnapshot(2, 20, 0), "")
    assert s.report(rep("a"))["budget"]["node_cap"] <= 12
    # b goes silent: dropped, its counters kept
    clock.t = 1.5
    s.report(rep("a"))
    clock.t = 3.0
    assert s.prune() == ["b"] and list(s.replicas) == ["a"]
    assert s.counters()["requests"] == 5 and s.dropped == 1
    # a new replica gets the current (override) budget at registration
    s.set_override(Budget.chain(2))
    assert s.report(rep("c"))["budget"] == {"theta": 0.0, "node_cap": 2, "branch_cap": 1}
    st = s.status()
    assert set(st["replicas"]) == {"a", "c"} and st["override"]["node_cap"] == 2


def test_online_calibration_is_pushed():
    s = ControllerState(LadderPolicy(), online_calibration=True, min_calibration_records=10)
    out = s.report(rep("a", records=[(1.0, True, 0.0), (-1.0, False, 0.0)] * 10 + [(1.0, False, 0.0), (-1.0, True, 0.0)] * 2))
    assert out["calibration"] is not None and out["calibration"][0] > 0


def test_controller_learns_acceptance_up_to_the_engines_max_tree_nodes():
    from deployments.controller.controller import Controller

    c = Controller(AppArgs(max_tree_nodes=40).wire())
    assert c.state.rounds.max_nodes == 40
    c.configure(AppArgs(max_tree_nodes=96).wire())
    assert c.state.rounds.max_nodes == 96


def test_a_fixed_override_pauses_the_replicas_allocation_until_released():
    s = ControllerState(LadderPolicy())
    assert s.report(rep("a"))["allocate"]
    s.set_override(Budget.chain(2), fixed=True)
    r = s.report(rep("a"))
    assert r["budget"]["node_cap"] == 2 and not r["allocate"] and s.status()["override_fixed"]
    s.set_override(Budget.chain(2))            # pinned, but the allocation may cut it
    assert s.report(rep("a"))["allocate"]
    s.set_override(Budget.chain(3), fixed=True)
    s.set_override(None, fixed=True)           # a release is never fixed
    assert s.report(rep("a"))["allocate"] and not s.status()["override_fixed"]

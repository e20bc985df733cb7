"""The controller's state without Ray: load aggregation, budgets, registration, the online refit."""



from deployments.config import AppArgs
from deployments.controller.state import (
    ControllerState,
    aggregate_load,
    assign_budgets,
    expired,
    replica_loads,
)
from deployments.reports import ReplicaReport, TreeStats
from treespark.pricing.policy import LadderPolicy, LoadSnapshot, PerStepPolicy
from treespark.spec.budget import Budget


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def rep(rid, active=0, queued=0, steps=0, step_s=0.0, counters=None, records=(), source="local"):
    return ReplicaReport(rid, active, queued, 10.0, TreeStats(steps=steps, step_s=step_s), {"theta": 0.0, "node_cap": 0, "branch_cap": 1},
                         source, counters or {}, tuple(records))


def test_aggregate_and_assign():
    load = aggregate_load([rep("a", 3, 1, steps=2, step_s=0.1), rep("b", 5, 0), rep("c", 0, 0, steps=1, step_s=0.3)])
    assert (load.replicas, load.active, load.queued) == (3, 8, 1)
    p = LadderPolicy()
    loads = {"a": load, "b": load}
    assert assign_budgets(p, loads) == {"a": p.budget_for(load, "a"), "b": p.budget_for(load, "b")}
    assert set(assign_budgets(p, {"a": load}, override=Budget.chain(3)).values()) == {Budget.chain(3)}
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


# -- the price source: the cluster's load, or each replica's own ---------------------------

PERSTEP = PerStepPolicy(max_nodes=32, max_branch=8, max_batch=4)


def test_replica_loads_are_the_clusters_or_each_replicas_own():
    reports = {"a": rep("a", 4, 10), "b": rep("b", 4, 0)}
    cluster = aggregate_load(reports.values())
    assert replica_loads(cluster, reports) == {"a": cluster, "b": cluster}
    local = replica_loads(cluster, reports, cluster_pricing=False)
    assert local == {"a": LoadSnapshot(1, 4, 10), "b": LoadSnapshot(1, 4, 0)}


def test_local_pricing_prices_each_replicas_own_queue_and_switches_back():
    """A queue on one replica: the cluster's theta is that of the mean queue (10 waiting over
    2 replicas: 5 per replica), the local one is each replica's (10 and none)."""
    s = ControllerState(PERSTEP)
    s.report(rep("a", 4, 10))
    s.report(rep("b", 4, 0))
    theta = {rid: e.budget.theta for rid, e in s.replicas.items()}
    assert theta["a"] == theta["b"] == PERSTEP.theta(LoadSnapshot(2, 8, 10)) > 0
    s.set_pricing(False)          # applied at once to the budgets the next replies carry
    assert s.replicas["a"].budget.theta == PERSTEP.theta(LoadSnapshot(1, 4, 10)) > theta["a"]
    assert s.replicas["b"].budget.theta == 0.0
    assert s.status()["price_source"] == "local"
    assert s.report(rep("b", 4, 0, source="controller"))["budget"]["theta"] == 0.0
    s.set_pricing(True)
    assert s.replicas["a"].budget == s.replicas["b"].budget and s.replicas["b"].budget.theta == theta["a"]
    assert s.status()["price_source"] == "cluster"


def test_an_override_wins_over_either_price_source():
    s = ControllerState(PERSTEP, cluster_pricing=False)
    s.report(rep("a", 4, 10))
    s.set_override(Budget.chain(2))
    assert s.replicas["a"].budget == Budget.chain(2)
    s.set_override(None)
    assert s.replicas["a"].budget.theta == PERSTEP.theta(LoadSnapshot(1, 4, 10))


def test_each_replica_shows_the_price_source_of_the_budget_it_runs():
    """A reply carries a budget priced on the current source; the replica applies it before its
    next report, so that report is the first to show the source."""
    s = ControllerState(PERSTEP)

    def shown(rid):
        return s.status()["replicas"][rid]["price_source"]

    s.report(rep("a"))                                   # its first report: it runs its local budget
    assert shown("a") == "local"
    s.report(rep("a", source="controller"))
    assert shown("a") == "cluster"
    s.set_pricing(False)
    assert shown("a") == "cluster"                       # no reply since the switch
    s.report(rep("a", source="controller"))              # this reply carries the local price ...
    assert shown("a") == "cluster"
    s.report(rep("a", source="controller"))              # ... this report shows it applied
    assert shown("a") == "local"
    s.set_pricing(True)
    s.report(rep("a", source="controller"))
    s.report(rep("a", source="local"))                   # the controller unreachable meanwhile: its own price
    assert shown("a") == "local"
    s.report(rep("a", source="controller"))
    assert shown("a") == "cluster"


def test_the_controller_actor_starts_and_redeploys_with_the_configs_price_source():
    from deployments.config import ControllerArgs
    from deployments.controller.controller import Controller

    c = Controller(AppArgs(controller=ControllerArgs(pricing=False)).wire())
    assert not c.state.cluster_pricing
    c.set_pricing(True)
    assert c.state.cluster_pricing
    c.configure(AppArgs(controller=ControllerArgs(pricing=False)).wire())
    assert not c.state.cluster_pricing

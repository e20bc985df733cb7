"""The controller as the cluster's price-setter (per-step policy): the price theta from
queueing, its reply, the pooled refit's guards, the default configs. No torch, no Ray."""

from __future__ import annotations

import math
import random
from pathlib import Path

import yaml

from deployments.config import AppArgs
from deployments.controller.state import ControllerState, queue_growth
from deployments.reports import ReplicaReport, TreeStats
from treespark.pricing.policy import LadderPolicy, LoadSnapshot, PerStepPolicy
from treespark.spec.budget import Budget

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def rep(rid, active=0, queued=0, records=()):
    return ReplicaReport(rid, active, queued, 10.0, TreeStats(), {"theta": 0.0, "node_cap": 32, "branch_cap": 4},
                         "controller", {}, tuple(records))


def test_no_queue_no_floor_and_the_floor_rises_with_the_queue():
    p = PerStepPolicy(max_nodes=32, max_branch=4, max_batch=8)
    idle = p.budget_for(LoadSnapshot(2, 6, 0))
    assert idle == Budget(0.0, 32, 4)                          # the engines' allocation alone decides
    assert p.theta(LoadSnapshot(2, 16, 0)) == 0.0              # full batches, nobody waiting beyond
    thetas = [p.theta(LoadSnapshot(2, 16, q)) for q in (2, 8, 16, 64)]
    assert 0 < thetas[0] < thetas[1] < thetas[2] < thetas[3] <= p.max_theta
    assert p.theta(LoadSnapshot(2, 16, 2, queue_growth=4.0)) > thetas[0]   # a growing queue: dearer still
    assert p.theta(LoadSnapshot(2, 6, 2, queue_growth=4.0)) == 0.0        # arrivals that fit the batches: free
    assert p.theta(LoadSnapshot(1, 8, 10_000)) == p.max_theta


def test_queue_growth_is_the_recent_slope():
    assert queue_growth([(0.0, 0), (0.25, 1)]) == 0.0           # too few points
    assert queue_growth([(t / 4, t) for t in range(10)]) == 4.0
    assert queue_growth([(t / 4, 10 - t) for t in range(10)]) == 0.0
    assert queue_growth([(0.0, 50)] + [(10 + t / 4, 3) for t in range(5)]) == 0.0   # old points out of the window


def test_the_controller_raises_the_price_when_the_cluster_queues_and_stamps_it():
    clock = Clock()
    s = ControllerState(PerStepPolicy(max_batch=8), clock=clock)
    first = s.report(rep("a", active=4))
    assert first["budget"]["theta"] == 0.0
    thetas = []
    for i in range(8):                                          # a queue building on replica b
        clock.t += 0.25
        s.report(rep("a", active=8))
        reply = s.report(rep("b", active=8, queued=2 + 3 * i))
        thetas.append(reply["budget"]["theta"])
    assert thetas[0] > 0 and all(y >= x for x, y in zip(thetas, thetas[1:], strict=False)) and thetas[-1] > thetas[0]
    assert s.replicas["a"].budget == s.replicas["b"].budget                 # one cluster price
    assert reply["priced_at"] > 0 and s.status()["queue_growth"] > 0
    clock.t += 5                                                # the queue drains: the price falls back
    for _ in range(4):
        clock.t += 0.25
        s.report(rep("a", active=3))
        reply = s.report(rep("b", active=3))
    assert reply["budget"]["theta"] == 0.0


def records(rng, n, a, b):
    out = []
    for _ in range(n):
        q = rng.random() * 0.98 + 0.01
        x = math.log(q / (1 - q))
        out.append((x, rng.random() < 1 / (1 + math.exp(-(a * x + b))), 0.0))
    return out


def test_the_pooled_refit_waits_for_records_and_is_on_by_default():
    assert AppArgs().controller.online_calibration
    s = ControllerState(PerStepPolicy(), min_calibration_records=400)
    rng = random.Random(0)
    assert s.report(rep("a", records=records(rng, 300, 2.0, 0.5)))["calibration"] is None   # too few
    out = s.report(rep("b", records=records(rng, 300, 2.0, 0.5)))     # pooled across replicas: enough
    assert out["calibration"] is not None and out["calibration"][0] > 1.0


def test_drift_cuts_the_pool_to_the_newest_records():
    s = ControllerState(PerStepPolicy(), min_calibration_records=400, calibration_prior_records=0)
    rng = random.Random(1)
    s.report(rep("a", records=records(rng, 2000, 1.0, 1.5)))        # accepts most drafts
    assert s.calibration is not None and s.calibration_report["drift"] is False
    s.report(rep("a", records=records(rng, 1200, 1.0, -2.5)))       # the drafter got worse
    assert s.calibration_report["drift"] is True
    assert len(s.records) < 2000 and s.calibration[1] < 0


def test_the_default_configs_run_the_per_step_policy_and_the_ladder_stays():
    for name in ("cluster.yaml", "gpu-cluster.yaml"):
        args = yaml.safe_load((ROOT / "configs" / name).read_text())["applications"][0]["args"]
        a = AppArgs.model_validate(args)
        assert a.policy.kind == "perstep" and isinstance(a.policy.build(a.max_batch_size), PerStepPolicy)
        assert a.controller.pricing and a.controller.online_calibration
    ladder = AppArgs.model_validate({"policy": {"kind": "ladder"}})
    assert isinstance(ladder.policy.build(8), LadderPolicy)
    local = AppArgs.model_validate({"policy": {"kind": "perstep"}, "controller": {"pricing": False}})
    assert not local.controller.pricing


def test_local_only_replicas_report_but_price_themselves(monkeypatch):
    """controller.pricing false: the controller observes (status, metrics), the replica
    runs its own policy; with pricing on, the controller's budget is applied and its
    arrival timed."""
    import ray

    from deployments.replica.core import ReplicaCore

    class Handle:
        def __init__(self, reply):
            self.reply, self.reports = reply, []
            self.report = self

        def remote(self, report):
            self.reports.append(report)
            return self.reply

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    priced = {"budget": {"theta": 0.4, "node_cap": 8, "branch_cap": 2}, "priced_at": 1.0,
              "registered": True, "calibration": None}
    for pricing, expect in ((False, Budget(0.0, 32, 8)), (True, Budget(0.4, 8, 2))):
        args = AppArgs(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_context=64,
                       max_batch_size=2, policy={"kind": "perstep"}, controller={"pricing": pricing})
        core = ReplicaCore(args, "r0", connect=None)
        try:
            h = Handle(priced)
            core.heartbeat.heartbeat_once(h, 0.25)
            assert len(h.reports) == 1 and core.heartbeat.registrations == 1
            assert core.heartbeat.budget == expect
            assert core.heartbeat.budget_source == ("controller" if pricing else "local")
            assert (len(core.heartbeat.price_latency) == 1) is pricing
        finally:
            core.shutdown()


def test_a_fixed_override_reaches_the_engine_loop_and_its_release_too(monkeypatch):
    """The controller's ``allocate: false`` (a fixed override) parks the replica's
    per-step allocation; ``allocate: true`` (or the controller gone) gives it back."""
    import ray

    from deployments.replica.core import ReplicaCore

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    args = AppArgs(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_context=64,
                   max_batch_size=2, policy={"kind": "perstep"})
    core = ReplicaCore(args, "r0", connect=None)
    sent = []
    monkeypatch.setattr(core.heartbeat.loop, "set_allocating", sent.append)

    class Handle:
        def __init__(self, allocate):
            self.reply = {"budget": {"theta": 0.0, "node_cap": 2, "branch_cap": 1}, "allocate": allocate,
                          "priced_at": 1.0, "registered": False, "calibration": None}
            self.report = self

        def remote(self, report):
            return self.reply

    try:
        core.heartbeat.heartbeat_once(Handle(False), 0.25)
        core.heartbeat.heartbeat_once(Handle(False), 0.25)   # unchanged: not sent again
        assert sent == [False] and not core.heartbeat.allocating
        core.heartbeat.heartbeat_once(Handle(True), 0.25)
        core.heartbeat.heartbeat_once(Handle(False), 0.25)
        core.heartbeat._use_local_policy()                   # the controller unreachable
        assert sent == [False, True, False, True] and core.heartbeat.allocating
    finally:
        core.shutdown()

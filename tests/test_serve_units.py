"""Serving pieces without Ray: controller math, the engine loop, the replica core, text."""

import asyncio
import math
import random
import threading
from pathlib import Path

import pytest
import yaml
from serving.fake_engine import FakeEngine, SamplingParams, build_fake_engine

from deployments.config import AppArgs
from deployments.controller_state import ControllerState, aggregate_load, assign_budgets, expired
from deployments.engine_loop import ACCEPTED, SCHEDULED, Aborted, EngineLoop, Failed
from deployments.replica_core import ReplicaCore
from deployments.reports import ReplicaReport, TreeStats
from deployments.text import ByteTokenizer, Detokenizer, StopMatcher
from treespark.budget import Budget
from treespark.pricing.estimators import fit_ab
from treespark.pricing.policy import LadderPolicy, LoadSnapshot


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def rep(rid, active=0, queued=0, steps=0, step_s=0.0, counters=None, records=()):
    return ReplicaReport(rid, active, queued, 10.0, TreeStats(steps=steps, step_s=step_s), {"theta": 0.0, "node_cap": 0, "branch_cap": 1},
                         "local", counters or {}, tuple(records))


# -- controller math ---------------------------------------------------------------

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


def test_fit_ab_recovers_parameters():
    rng = random.Random(0)
    a, b = 1.7, -0.4
    recs = []
    for _ in range(4000):
        x, o = rng.uniform(-4, 3), rng.choice((0.0, -1.2))
        recs.append((x, rng.random() < 1 / (1 + math.exp(-(a * x + b + o))), o))
    fa, fb = fit_ab(recs)
    assert abs(fa - a) < 0.2 and abs(fb - b) < 0.2
    # the offsets matter: dropping them biases b
    _, fb0 = fit_ab([(x, y, 0.0) for x, y, _ in recs])
    assert fb0 < b - 0.3


def test_fit_ab_converges_when_acceptance_depends_weakly_on_q():
    rng = random.Random(3)
    recs = []
    for _ in range(4000):
        q = rng.random() ** 3 * 0.98 + 1e-5
        x = math.log(q / (1 - q))
        recs.append((x, rng.random() < 1 / (1 + math.exp(-(0.2 * x - 1.0))), 0.0))
    fa, fb = fit_ab(recs)
    assert abs(fa - 0.2) < 0.05 and abs(fb + 1.0) < 0.1


def test_online_calibration_is_pushed():
    s = ControllerState(LadderPolicy(), online_calibration=True, min_calibration_records=10)
    out = s.report(rep("a", records=[(1.0, True, 0.0), (-1.0, False, 0.0)] * 10 + [(1.0, False, 0.0), (-1.0, True, 0.0)] * 2))
    assert out["calibration"] is not None and out["calibration"][0] > 0


# -- text ---------------------------------------------------------------------------

def test_detokenizer_holds_incomplete_utf8():
    tok = ByteTokenizer(512)
    ids = tok.encode("hé!")
    d = Detokenizer(tok)
    assert d.push(ids[:2]) == "h"  # 'é' is two bytes: wait for the second
    assert d.push(ids[2:]) == "é!"


def test_stop_matcher_across_deltas():
    m = StopMatcher(["END"])
    out = []
    for piece in ["ab", "cE", "N", "Dxyz"]:
        text, hit = m.feed(piece)
        out.append(text)
    assert "".join(out) == "abc" and hit
    m2 = StopMatcher(["zz"])
    assert m2.feed("abz") == ("ab", False) and m2.flush() == "z"


# -- the engine loop and the replica core ---------------------------------------------

def test_engine_loop_add_error_abort():
    loop = EngineLoop(FakeEngine(step_sleep_s=0.005)).start()
    got = {"a": [], "b": [], "c": []}
    loop.add("a", [1, 2], SamplingParams(max_tokens=5), got["a"].append)
    loop.add("b", [], SamplingParams(), got["b"].append)
    loop.add("c", [1], SamplingParams(max_tokens=500), got["c"].append)
    import time

    deadline = time.time() + 5
    while time.time() < deadline and not (got["a"] and getattr(got["a"][-1], "finished", False)):
        time.sleep(0.01)
    loop.abort("c")
    time.sleep(0.1)
    loop.stop()
    assert got["a"][0] is ACCEPTED and got["a"][1] is SCHEDULED and got["a"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in got["a"][2:]) == 5
    assert isinstance(got["b"][0], Failed) and isinstance(got["b"][0].error, ValueError)
    assert isinstance(got["c"][-1], Aborted) and "c" in loop.engine.aborted_ids
    assert loop.drain_step_stats()


class _FlakyEngine(FakeEngine):
    """``step`` raises once when ``fail`` is set; ``abort("b")`` frees b, then raises."""

    fail = False

    def step(self):
        if self.fail:
            self.fail = False
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()

    def abort(self, request_id):
        super().abort(request_id)
        if request_id == "b":
            raise RuntimeError("abort failed")


def _wait(cond, timeout=5.0):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and not cond():
        time.sleep(0.01)
    assert cond()


def test_engine_loop_survives_a_failed_step():
    engine = _FlakyEngine(max_batch_size=2, step_sleep_s=0.005)
    loop = EngineLoop(engine).start()
    got = {rid: [] for rid in "abcd"}
    try:
        for rid in "abc":  # a and b run, c waits for a batch row
            loop.add(rid, [1, 2], SamplingParams(max_tokens=500), got[rid].append)
        _wait(lambda: len(got["a"]) > 2 and len(got["b"]) > 2)
        assert engine.num_running == 2 and engine.num_waiting == 1
        engine.fail = True
        _wait(lambda: all(got[rid] and isinstance(got[rid][-1], Failed) for rid in "abc"))
        # every request in flight (running or waiting) got one final error and was aborted in the engine
        for rid in "abc":
            failed = [x for x in got[rid] if isinstance(x, Failed)]
            assert len(failed) == 1 and "engine step failed" in str(failed[0].error) and "illegal memory" in str(failed[0].error)
        assert set(engine.aborted_ids) == {"a", "b", "c"}
        assert engine.num_running == 0 and engine.num_waiting == 0
        assert loop.alive and "illegal memory" in loop.last_error
        n = {rid: len(got[rid]) for rid in "abc"}
        # the loop serves on; the failed requests hear nothing more
        loop.add("d", [1, 2], SamplingParams(max_tokens=5), got["d"].append)
        _wait(lambda: got["d"] and getattr(got["d"][-1], "finished", False))
        assert got["d"][0] is ACCEPTED and got["d"][-1].finish_reason == "length"
        assert {rid: len(got[rid]) for rid in "abc"} == n and loop.alive and loop.load.alive
    finally:
        loop.stop()


class _BadPushEngine(FakeEngine):
    def set_budget(self, budget):
        raise ValueError("node_cap above the engine's max_tree_nodes")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_engine_loop_survives_a_failed_budget_push_and_fails_waiters_when_it_dies():
    engine = _BadPushEngine(max_batch_size=1, step_sleep_s=0.005)
    loop = EngineLoop(engine).start()
    got = {rid: [] for rid in "ab"}
    try:
        loop.set_budget(object())
        loop.add("a", [1, 2], SamplingParams(max_tokens=5), got["a"].append)
        _wait(lambda: got["a"] and getattr(got["a"][-1], "finished", False))
        assert loop.alive and "max_tree_nodes" in loop.last_error
        # the thread dies from something unexpected: what waits still hears an error
        loop.add("b", [1, 2], SamplingParams(max_tokens=400), got["b"].append)
        _wait(lambda: len(got["b"]) > 2)
        engine.has_unfinished = lambda: (_ for _ in ()).throw(SystemExit("boom"))
        engine.step = engine.has_unfinished
        loop.set_budget(None)  # wakes the loop; _has_work swallows Exception, not SystemExit
        _wait(lambda: isinstance(got["b"][-1], Failed))
        assert not loop.alive
    finally:
        loop.stop()


def test_engine_loop_call_and_attach():
    """Work posted with ``call`` runs on the loop thread (where the engine must be built);
    requests fail until an engine is attached; a call the loop never runs raises."""
    loop = EngineLoop(name="eng-under-test").start()
    got = []
    try:
        loop.add("early", [1, 2], SamplingParams(max_tokens=3), got.append)
        _wait(lambda: got)
        assert isinstance(got[0], Failed) and "not ready" in str(got[0].error)
        assert loop.call(lambda: threading.current_thread().name) == "eng-under-test"
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0)
        loop.attach(FakeEngine(step_sleep_s=0.001))
        with pytest.raises(RuntimeError, match="already has an engine"):
            loop.attach(FakeEngine())
        got.clear()
        loop.add("a", [1, 2], SamplingParams(max_tokens=3), got.append)
        _wait(lambda: got and getattr(got[-1], "finished", False))
        assert got[0] is ACCEPTED and got[1] is SCHEDULED and sum(len(o.new_token_ids) for o in got[2:]) == 3
    finally:
        loop.stop()
    with pytest.raises(RuntimeError, match="not running"):
        loop.call(lambda: None)


class _DyingEngine(FakeEngine):
    gate = threading.Event()

    def step(self):
        self.gate.wait(5)
        raise SystemExit("boom")  # not an Exception: the loop thread dies


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_engine_loop_call_queued_behind_a_dying_loop_raises():
    engine = _DyingEngine(step_sleep_s=0.001)
    loop = EngineLoop(engine).start()
    got, errors = [], []

    def call():
        try:
            loop.call(lambda: "never")
        except RuntimeError as err:
            errors.append(err)

    try:
        loop.add("a", [1, 2], SamplingParams(max_tokens=5), got.append)
        _wait(lambda: got)  # accepted; the loop is now inside step(), waiting on the gate
        caller = threading.Thread(target=call)
        caller.start()
        _wait(lambda: loop._cmds.qsize() == 1)
        engine.gate.set()
        caller.join(5)
        assert not caller.is_alive() and len(errors) == 1 and "stopped" in str(errors[0])
        assert isinstance(got[-1], Failed)
        _wait(lambda: not loop.alive)
    finally:
        loop.stop()


BUILT_ON: list[str] = []


def build_recording_engine(args):
    BUILT_ON.append(threading.current_thread().name)
    return build_fake_engine(args)


def test_replica_core_builds_its_engine_on_the_loop_thread():
    BUILT_ON.clear()
    args = AppArgs(model="random", engine_factory="test_serve_units:build_recording_engine", max_context=64)
    core = ReplicaCore(args, "r0", connect=None)
    try:
        assert BUILT_ON == ["treespark-engine"] and core.loop.alive
        evs = asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 4, "temperature": 0.0}))
        assert evs[-1]["type"] == "end" and evs[-1]["usage"]["completion_tokens"] == 4
    finally:
        core.shutdown()


def _core(**kw):
    args = AppArgs(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_context=64, **kw)
    return ReplicaCore(args, "r0", connect=None)


async def _collect(core, req):
    return [ev async for ev in core.generate(req)]


def test_replica_core_generate_and_errors():
    core = _core()
    try:
        evs = asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 6, "temperature": 0.0}))
        assert evs[0]["type"] == "start" and evs[-1]["type"] == "end"
        assert evs[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
        assert "".join(e["text"] for e in evs if e["type"] == "delta") == "cdefgh"
        # stop string: 'e' ends the text before it
        evs = asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 30, "stop": ["ef"]}))
        assert "".join(e["text"] for e in evs if e["type"] == "delta") == "cd" and evs[-1]["finish_reason"] == "stop"
        # stop token id
        evs = asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 30, "stop_token_ids": [ord("e")]}))
        assert evs[-1]["finish_reason"] == "stop" and evs[-1]["usage"]["completion_tokens"] == 3
        for req, param in [({"prompt": "", "max_tokens": 2}, "prompt"), ({"prompt": "x" * 70}, "prompt"),
                           ({"prompt": "ab", "max_tokens": 63}, "max_tokens"), ({"prompt_ids": [9999]}, "prompt")]:
            (ev,) = asyncio.run(_collect(core, req))
            assert ev["type"] == "error" and ev["status"] == 400 and ev["param"] == param, (req, ev)
        # a consumer that goes away aborts the request in the engine
        async def partial():
            agen = core.generate({"prompt": "ab", "max_tokens": 50, "request_id": "gone"})
            await agen.__anext__()
            await agen.__anext__()
            await agen.aclose()
            await asyncio.sleep(0.1)
        asyncio.run(partial())
        assert "gone" in core.bundle.engine.aborted_ids
        report = core.make_report(1.0)
        assert report["counters"]["requests"] == 3 and report["counters"]["requests_aborted"] == 1
        assert report["tree"]["steps"] > 0
    finally:
        core.shutdown()


@pytest.mark.parametrize("factory,per_step", [("build_fake_engine", 3), ("build_fake_engine_with_sampled_map", 2)])
def test_heartbeat_sends_sampled_records_only_without_a_sampled_map(factory, per_step):
    """The online refit is of the T = 0 map: T > 0 rows' records describe it only when
    the same map drafts at T > 0 (the fake engine emits 2 greedy and 1 sampled per step)."""
    args = AppArgs(model="random", engine_factory=f"serving.fake_engine:{factory}", max_context=64)
    core = ReplicaCore(args, "r0", connect=None)
    try:
        asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 6}))
        report = core.make_report(1.0)
        assert report["tree"]["steps"] > 0
        assert len(report["calibration_records"]) == per_step * report["tree"]["steps"]
    finally:
        core.shutdown()


def test_configs_validate():
    for path in ("configs/cluster.yaml", "configs/gpu-cluster.yaml"):
        cfg = yaml.safe_load(open(path))
        from ray.serve.schema import ServeDeploySchema

        ServeDeploySchema.model_validate(cfg)
        (app,) = cfg["applications"]
        args = AppArgs.model_validate(app["args"])
        assert app["import_path"] == "deployments.app:build_app"
        assert cfg["http_options"]["host"] == "127.0.0.1"
        from deployments.app import build_app, replica_options

        build_app(args)  # builds the graph; nothing runs
        opts = replica_options(args)
        assert set(opts["ray_actor_options"]) == {"num_cpus", "num_gpus"}
        assert opts["autoscaling_config"]["max_replicas"] >= 2
        if "gpu" in path:
            assert args.model == "Qwen/Qwen3-4B" and args.drafter == "deepseek-ai/dspark_qwen3_4b_block7"
            assert opts["ray_actor_options"]["num_gpus"] == 1
        else:
            assert opts["ray_actor_options"]["num_gpus"] == 0


def test_budgets_the_engines_would_clip_are_refused():
    from pydantic import ValidationError

    fixed = {"kind": "fixed", "budget": {"theta": 0.0, "node_cap": 48, "branch_cap": 4}}
    assert AppArgs(policy=fixed, max_tree_nodes=48).policy.budget.node_cap == 48
    with pytest.raises(ValidationError, match=r"policy.budget.node_cap is 48 but max_tree_nodes is 32"):
        AppArgs(policy=fixed, max_tree_nodes=32)
    with pytest.raises(ValidationError, match=r"policy.budgets\[0\].node_cap is 24 but max_tree_nodes is 16"):
        AppArgs(max_tree_nodes=16, policy={"thresholds": [2.0], "budgets": [
            {"theta": 0.0, "node_cap": 24, "branch_cap": 4}, {"theta": 1.0, "node_cap": 0, "branch_cap": 1}]})
    with pytest.raises(ValidationError, match=r"policy.max_nodes is 32 but max_tree_nodes is 8"):
        AppArgs(max_tree_nodes=8, policy={"kind": "costmodel", "cost_model": "configs/costmodel-smollm2.json"})
    shipped = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))
    assert len(shipped) >= 5
    for path in shipped:
        (app,) = yaml.safe_load(path.read_text())["applications"]
        AppArgs.model_validate(app["args"])  # the shipped configs stay valid


def test_controller_learns_acceptance_up_to_the_engines_max_tree_nodes():
    from deployments.controller import Controller

    c = Controller(AppArgs(max_tree_nodes=40).wire())
    assert c.state.rounds.max_nodes == 40
    c.configure(AppArgs(max_tree_nodes=96).wire())
    assert c.state.rounds.max_nodes == 96


def test_round_records_are_keyed_by_each_rows_node_cap():
    from deployments.heartbeat import round_records
    from treespark.params import StepStats

    base = dict(batch_size=3, tokens_verified=9, depths=(2, 0, 1), widths=(2, 0, 1), theta=0.1,
                draft_s=0.0, verify_s=0.0, step_s=0.0)
    s = StepStats(tree_sizes=(4, 0, 1), accepted=(2, 0, 1), node_caps=(8, 8, 2), **base)
    # the empty tree counts as a round at its cap that accepted nothing, not at the widest tree
    assert round_records(s) == [(8, 2), (8, 0), (2, 1)]


def test_detokenizer_streams_the_default_tokenizer_losslessly():
    """Token by token, the deltas join to the whole output's decode: multi-byte
    characters split across byte-level tokens, emoji, CJK, leading spaces, newlines."""
    from transformers import AutoTokenizer

    from treespark.fetch import default_cache_dir, fetch_default_target

    tok = AutoTokenizer.from_pretrained(fetch_default_target(default_cache_dir(), progress=False))
    text = "Hé said: 你好, world 🙂!\n  def f(x):\n\treturn x ** 2  # ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    d = Detokenizer(tok)
    deltas = [d.push([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert "" in deltas  # some token only started a character, and waited for the next
    d2 = Detokenizer(tok)
    assert d2.push(ids[:7]) + d2.push(ids[7:]) == tok.decode(ids)

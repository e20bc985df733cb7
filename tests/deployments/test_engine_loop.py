"""The engine loop: its thread, commands, failures and waiters (a fake engine)."""

import threading

import pytest
from serving.fake_engine import FakeEngine, SamplingParams

from deployments.replica.engine_loop import (
    ACCEPTED,
    SCHEDULED,
    Aborted,
    EngineLoop,
    Failed,
    ServedEngine,
)


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


class _BadPushEngine(FakeEngine):
    def set_budget(self, budget):
        raise ValueError("node_cap above the engine's max_tree_nodes")


class _DyingEngine(FakeEngine):
    gate = threading.Event()

    def step(self):
        self.gate.wait(5)
        raise SystemExit("boom")  # not an Exception: the loop thread dies


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


def test_the_engine_and_the_fake_satisfy_the_served_engine_protocol():
    from treespark import random_pair
    from treespark.engine.config import EngineConfig
    from treespark.engine.core import Engine

    engine = Engine(random_pair(64, 0), EngineConfig(max_batch_size=2, max_context=32))
    assert isinstance(engine, ServedEngine) and engine.kv_usage == 0
    assert isinstance(FakeEngine(), ServedEngine)
    with pytest.raises(TypeError, match="not a ServedEngine"):
        EngineLoop(object())


class _HeldEngine(FakeEngine):
    """Each step waits for a release of ``go``, then counts a preemption and a cached
    prompt token (it preempts nothing), so that the loop's copies can be checked."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.go = threading.Semaphore(0)

    def step(self):
        self.go.acquire(timeout=5)
        out = super().step()
        self.prefix_cache_hits += 1
        self.preemptions += 1
        return out


def test_engine_loop_load_carries_kv_usage_and_the_engine_counters():
    engine = _HeldEngine(max_batch_size=4)
    loop = EngineLoop(engine).start()
    try:
        got = []
        loop.add("a", [1, 2, 3], SamplingParams(max_tokens=100, stop_token_ids=()), got.append)
        engine.go.release()                             # step 1: admitted, its first tokens
        _wait(lambda: loop.load.running == 1)
        load = loop.load                                # the snapshot after step 1
        assert load.kv_usage == 0.25 and load.prefix_cache_queries == 3
        assert load.prefix_cache_hits == 1 and load.preemptions == 1
        engine.go.release(1000)                         # the rest, to the end
        _wait(lambda: got and got[-1].finished and loop.load.running == 0)
        load = loop.load
        assert load.kv_usage == 0 and load.prefix_cache_queries == 3
        assert load.prefix_cache_hits == load.preemptions == engine.preemptions > 1
    finally:
        engine.go.release(1000)
        loop.stop()


class _AllocatingEngine(FakeEngine):
    allocator = "the step allocator"

    def set_allocator(self, allocator):
        self.allocator = allocator


def test_set_allocating_parks_the_engines_allocator_and_gives_it_back():
    eng = _AllocatingEngine()
    loop = EngineLoop(eng).start()
    try:
        loop.set_allocating(False)
        assert loop.call(lambda: eng.allocator) is None
        loop.set_allocating(False)            # twice: still parked, not lost
        loop.set_allocating(True)
        assert loop.call(lambda: eng.allocator) == "the step allocator"
    finally:
        loop.stop()
    plain = EngineLoop(FakeEngine()).start()  # an engine without an allocation: left as it is
    try:
        plain.set_allocating(False)
        assert plain.call(lambda: plain.last_error) is None and plain.alive
    finally:
        plain.stop()

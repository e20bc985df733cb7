"""The replica core without Ray: its engine thread, generation, errors and heartbeat reports."""

import asyncio
import threading

import pytest
from serving.fake_engine import build_fake_engine

from deployments.config import AppArgs
from deployments.replica.core import ReplicaCore

BUILT_ON: list[str] = []


def build_recording_engine(args):
    BUILT_ON.append(threading.current_thread().name)
    return build_fake_engine(args)


def _core(**kw):
    args = AppArgs(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_context=64, **kw)
    return ReplicaCore(args, "r0", connect=None)


async def _collect(core, req):
    return [ev async for ev in core.generate(req)]


def test_replica_core_builds_its_engine_on_the_loop_thread():
    BUILT_ON.clear()
    args = AppArgs(model="random", engine_factory="test_replica_core:build_recording_engine", max_context=64)
    core = ReplicaCore(args, "r0", connect=None)
    try:
        assert BUILT_ON == ["treespark-engine"] and core.loop.alive
        evs = asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 4, "temperature": 0.0}))
        assert evs[-1]["type"] == "end" and evs[-1]["usage"]["completion_tokens"] == 4
    finally:
        core.shutdown()


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
        report = core.heartbeat.make_report(1.0)
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
        report = core.heartbeat.make_report(1.0)
        assert report["tree"]["steps"] > 0
        assert len(report["calibration_records"]) == per_step * report["tree"]["steps"]
    finally:
        core.shutdown()


def test_no_calibration_records_while_a_fixed_override_pins_the_trees():
    """The refit is of the map the replica's own allocation drafts with: steps run under a
    pinned fixed override (``allocating`` off) report no records; their rounds still count."""
    core = _core()
    try:
        core.heartbeat.apply_allocating(False)
        asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 6}))
        report = core.heartbeat.make_report(1.0)
        assert report["tree"]["steps"] > 0 and report["round_records"]
        assert report["calibration_records"] == []
        core.heartbeat.apply_allocating(True)
        asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 6}))
        assert len(core.heartbeat.make_report(1.0)["calibration_records"]) > 0
    finally:
        core.shutdown()


def test_round_records_are_keyed_by_each_rows_node_cap():
    from deployments.replica.heartbeat import round_records
    from treespark.spec.params import StepStats

    base = dict(batch_size=3, tokens_verified=9, depths=(2, 0, 1), widths=(2, 0, 1), theta=0.1,
                draft_s=0.0, verify_s=0.0, step_s=0.0)
    s = StepStats(tree_sizes=(4, 0, 1), accepted=(2, 0, 1), node_caps=(8, 8, 2), **base)
    # the empty tree counts as a round at its cap that accepted nothing, not at the widest tree
    assert round_records(s) == [(8, 2), (8, 0), (2, 1)]


def build_refused_engine(args):
    from treespark.models.errors import DrafterCheckpointError

    raise DrafterCheckpointError("drafter checkpoint /models/d is missing tensors: fc.weight")


def test_a_model_that_does_not_load_leaves_the_replica_up_and_saying_why(caplog):
    """No crash loop and no traceback: one log line, then 503 with the reason on every request
    and at /health (through the status), and a health check that does not restart it."""
    from deployments.http.responses import engine_error_response

    args = AppArgs(model="random", engine_factory="test_replica_core:build_refused_engine", max_context=64)
    with caplog.at_level("ERROR"):
        core = ReplicaCore(args, "r0", connect=None)
    try:
        reason = "drafter checkpoint /models/d is missing tensors: fc.weight"
        assert core.startup_error == reason
        (rec,) = [r for r in caplog.records if "cannot serve" in r.getMessage()]
        assert rec.exc_info is None and reason in rec.getMessage()
        told = "drafter checkpoint .../d is missing tensors: fc.weight"   # clients are told why, not where
        status = core.status()
        assert status["startup_error"] == told and status["engine_alive"] is False
        (ev,) = asyncio.run(_collect(core, {"prompt": "ab", "max_tokens": 4}))
        assert ev["type"] == "error" and ev["status"] == 503 and told in ev["message"]
        assert "/models" not in ev["message"]
        resp = engine_error_response(ev)
        assert resp.status_code == 503 and told.encode() in resp.body
    finally:
        core.shutdown()

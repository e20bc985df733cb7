"""Resuming a request whose engine replica died mid-generation (``deployments.http.resume``),
in-process: the API over two replica cores behind a stand-in handle whose first call dies
with Ray's ``ActorDiedError`` after a few events. The second replica continues after the
tokens sent; the client reads one unbroken stream equal to an uninterrupted one (stop
strings across the cut included); the counters in ``/metrics`` say what happened. Then
the same on the real engine (tiny random pair): a greedy stream and a reproducible
sampled one resume token for token, another sampled one continues the sent tokens to
full length."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from serving.inprocess import LocalApi, LocalReplicaHandle, _Gen
from serving.policies import LADDER
from test_metrics import parse, value

from deployments.config import AppArgs, BudgetArgs, LimitArgs, PolicyArgs
from deployments.http.resume import ResumableCall
from deployments.metrics import IngressMetrics
from deployments.replica.core import ReplicaCore

MODEL = "treespark-random"
FAKE = "serving.fake_engine:build_fake_engine"


class _Dying(_Gen):
    """A handle call whose replica dies after ``after`` events: the request is gone from its
    engine (aborted, as a killed actor's would be) and the reader gets ``error``."""

    def __init__(self, agen: Any, after: int, error: BaseException) -> None:
        super().__init__(agen)
        self._left, self._error = after, error

    async def __anext__(self) -> Any:
        if self._left == 0:
            self._task.cancel()
            raise self._error
        self._left -= 1
        return await super().__anext__()


class TwoReplicas(LocalReplicaHandle):
    """Call ``i`` goes to ``cores[min(i, 1)]``; the calls listed in ``die`` die after that
    many events; ``tamper(event)`` rewrites what the second core sends."""

    def __init__(self, cores: list[ReplicaCore], die: dict[int, int], error: BaseException | None = None,
                 tamper=None) -> None:
        super().__init__(cores[0])
        self.cores = cores
        self.requests: list[dict[str, Any]] = []
        self.first = cores[0].generate   # what the first call runs

        async def tampered(agen):
            async for ev in agen:
                yield tamper(ev) if tamper is not None else ev

        def generate(req: dict[str, Any]) -> _Gen:
            i = len(self.requests)
            self.requests.append(req)
            core = cores[min(i, 1)]
            agen = self.first(req) if i == 0 else tampered(core.generate(req))
            if i in die:
                return _Dying(agen, die[i], error or ActorDiedError())
            return _Gen(agen)

        self.generate.remote = generate


@pytest.fixture
def api():
    """``make(die, **kw)``: the API over two fake-engine cores (``LocalApi``'s and a second one)."""
    made: list[tuple[LocalApi, ReplicaCore]] = []

    def make(die: dict[int, int], retries: int = 2, factory: str = FAKE, **kw: Any) -> LocalApi:
        args = AppArgs(model="random", engine_factory=factory, vocab_size=512, max_batch_size=4, max_context=512,
                       limits=LimitArgs(replica_retries=retries))
        a = LocalApi(args)
        second = ReplicaCore(args, "local-1", connect=None)
        made.append((a, second))
        a.api.replica = TwoReplicas([a.core, second], die, **kw)
        return a

    yield make
    for a, second in made:
        second.shutdown()
        a.close()


def stream_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 40, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **kw}


def text_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def counters(a: LocalApi) -> dict[str, float]:
    m = parse(a.get("/metrics").body)
    return {"retries": value(m, "treespark:request_retries_total"),
            "resumes": value(m, "treespark:stream_resumes_total"),
            "resume_pauses": value(m, "treespark:stream_resume_seconds_count"),
            **{f"failed_{c}": value(m, "treespark:stream_failures_total", code=c)
               for c in ("replica_failed", "engine_error")}}


# -- the API over fake replicas --------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [ActorDiedError(), ActorUnavailableError("connection lost", None)])
def test_stream_resumes_on_another_replica_as_one_unbroken_stream(api, error):
    whole = api({}).post("/v1/completions", stream_body()).sse()
    a = api({0: 6}, error=error)   # start, then 5 deltas, then the replica dies
    before = counters(a)
    events = a.post("/v1/completions", stream_body()).sse()
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1]]
    assert not any("error" in e for e in chunks), chunks
    assert text_of(events) == text_of(whole) and len(text_of(events)) == 40
    assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 40 and usage["total_tokens"] == usage["prompt_tokens"] + 40
    handle = a.api.replica
    assert len(handle.requests) == 2 and handle.requests[0]["request_id"] != handle.requests[1]["request_id"]
    after = counters(a)
    assert after["retries"] - before["retries"] == 1 and after["resumes"] - before["resumes"] == 1
    assert after["resume_pauses"] - before["resume_pauses"] == 1
    assert all(after[k] == 0 for k in after if k.startswith("failed_"))


def test_chat_stream_and_a_non_streamed_request_resume_too(api):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "stream": True}
    whole = api({}).post("/v1/chat/completions", chat).sse()
    a = api({0: 3})
    events = a.post("/v1/chat/completions", chat).sse()
    content = ["".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"]) for ev in (whole, events)]
    assert content[0] == content[1] and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert sum(1 for e in events[:-1] if e["choices"][0]["delta"].get("role")) == 1   # one role chunk

    plain = {"model": MODEL, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
    want = api({}).post("/v1/completions", plain).json()
    b = api({0: 4})
    got = b.post("/v1/completions", plain).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
    assert counters(b)["retries"] == 1 and counters(b)["resumes"] == 0   # resumes count streams only


def test_a_replica_whose_engine_loop_stops_hands_its_streams_over(api):
    """The core ends a request whose engine loop stopped with ``replica_stopping``; the
    API resumes such a stream elsewhere like a dead replica's."""
    a = api({})
    whole = a.post("/v1/completions", stream_body()).sse()
    second = a.api.replica.cores[1]

    async def stop_after_first_delta(req):
        async for ev in a.core.generate(req):
            yield ev
            if ev["type"] == "delta":
                a.core.loop.stop()

    a.api.replica.first = stop_after_first_delta
    a.api.replica.requests.clear()   # the next call is the first again
    events = a.post("/v1/completions", stream_body()).sse()
    assert text_of(events) == text_of(whole) and not any("error" in e for e in events[:-1])
    assert counters(a)["resumes"] == 1 and second.counters["requests"] == 1


@pytest.mark.parametrize("seed", [None, 9])
def test_the_other_replica_continues_after_the_tokens_sent(api, seed):
    """... with the first's seed and switch: a client's seed keeps the stream reproducible."""
    a = api({0: 3})   # start, then 2 deltas, then the replica dies
    events = a.post("/v1/completions", stream_body(**({} if seed is None else {"seed": seed}))).sse()
    first, second = a.api.replica.requests
    assert "resume_ids" not in first
    assert second["seed"] == first["seed"] is not None and second["reproducible"] is first["reproducible"] is (
        seed is not None)
    sent = [ord(c) for c in text_of(events)][: len(second["resume_ids"])]
    assert second["resume_ids"] == sent and 0 < len(sent) < 40   # the byte tokenizer: one token a character
    assert len(text_of(events)) == 40 and events[-2]["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("cut", [2, 3, 4])
def test_a_stop_string_across_the_cut_still_stops_the_stream(api, cut):
    """The fake engine writes "pqrstu..." after "Hello"; "st" is held back until it cannot
    start the stop string, so the cut may fall between what was generated and what was sent."""
    body = stream_body(stop=["st"], max_tokens=12)
    whole = api({}).post("/v1/completions", body).sse()
    events = api({0: cut}).post("/v1/completions", body).sse()
    assert text_of(events) == text_of(whole) == "pqr"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")][-1] == "stop"


def test_a_continuation_with_nothing_left_to_generate_ends_at_once():
    args = AppArgs(model="random", engine_factory=FAKE, vocab_size=512, max_batch_size=2, max_context=64)
    core = ReplicaCore(args, "r", connect=None)
    loop = asyncio.new_event_loop()

    async def events(req):
        return [ev async for ev in core.generate(req)]

    try:
        done = loop.run_until_complete(events({"prompt": "Hi", "max_tokens": 3, "resume_ids": [106, 107, 108]}))
        assert [e["type"] for e in done] == ["start", "end"]
        assert done[1]["finish_reason"] == "length" and done[1]["usage"]["completion_tokens"] == 3
        rest = loop.run_until_complete(events({"prompt": "Hi", "max_tokens": 5, "resume_ids": [106, 107]}))
        assert "".join(e.get("text", "") for e in rest) == "lmn" and rest[-1]["usage"]["completion_tokens"] == 5
    finally:
        core.shutdown()
        loop.close()


def test_resumes_are_bounded(api):
    a = api({0: 4, 1: 6}, retries=1)   # the second replica dies too: no re-issue left
    events = a.post("/v1/completions", stream_body()).sse()
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "replica_failed"
    c = counters(a)
    assert c["failed_replica_failed"] == 1 and c["retries"] == 1 and len(a.api.replica.requests) == 2


def test_a_replica_that_dies_before_the_first_event_is_retried(api):
    a = api({0: 0})
    r = a.post("/v1/completions", stream_body())
    assert r.status == 200 and r.sse()[-1] == "[DONE]" and len(a.api.replica.requests) == 2
    c = counters(a)
    assert c["retries"] == 1 and c["resumes"] == 0
    b = api({0: 0, 1: 0}, retries=1)
    r = b.post("/v1/completions", stream_body())
    assert r.status == 503 and r.json()["error"]["code"] == "replica_failed"


def test_sampled_requests_get_a_seed_that_is_not_echoed(api):
    a = api({})
    r = a.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0.8})
    assert r.status == 200 and "seed" not in r.body.decode()
    a.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0.8, "seed": 5})
    a.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0})
    a.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0.8, "n": 2})
    a.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0.8, "seed": 6, "n": 2})
    seeds = [q["seed"] for q in a.api.replica.requests]
    assert isinstance(seeds[0], int) and 0 <= seeds[0] < 2**63
    assert seeds[1] == 5 and seeds[2] is None                 # a given seed stays; greedy needs none
    assert isinstance(seeds[3], int) and seeds[4] != seeds[3]  # choice 1 derives its own from choice 0's
    # a client's seed makes a sampled request reproducible (and its every choice); ours does not
    assert [q["reproducible"] for q in a.api.replica.requests] == [False, True, False, False, False, True, True]


# -- the real engine (tiny random pair), no Ray -------------------------------------------------------------

def _collect(call: ResumableCall, loop: asyncio.AbstractEventLoop) -> tuple[list[int], str, dict]:
    async def run():
        assert await call.open() is None
        ids, text, end = [], "", None
        async for ev in call:
            if ev["type"] == "delta":
                ids += ev["token_ids"]
                text += ev["text"]
            else:
                end = ev
        return ids, text, end

    return loop.run_until_complete(run())


@pytest.mark.parametrize(("temperature", "reproducible"), [(0.0, False), (1.0, False), (1.0, True)])
def test_real_engine_continues_the_stream(temperature, reproducible):
    # both replicas under the same fixed ladder, so that the first replica's part of the
    # cut stream is the uninterrupted stream's own (a seeded request that is not
    # reproducible draws tokens that depend on its draft trees: docs/stream-resume.md); a
    # reproducible one has the second replica draft chains of 2 instead
    args = AppArgs(model="random", vocab_size=512, max_batch_size=2, max_context=256, policy=LADDER)
    chains = args.model_copy(update={"policy": PolicyArgs(kind="fixed", budget=BudgetArgs(
        theta=0.0, node_cap=2, branch_cap=1))})
    cores = [ReplicaCore(args if i == 0 or not reproducible else chains, f"r{i}", connect=None) for i in range(2)]
    loop = asyncio.new_event_loop()
    try:
        req = {"request_id": "x", "prompt": "Hello", "max_tokens": 48, "temperature": temperature, "seed": 1234,
               "ignore_eos": True, "reproducible": reproducible}

        def opener(die: dict[int, int]):
            calls = []

            async def open_once(ereq):
                i = len(calls)
                calls.append(ereq)
                agen = cores[min(i, 1)].generate(ereq)
                gen = _Dying(agen, die[i], ActorDiedError()) if i in die else _Gen(agen)
                return gen, await gen.__anext__()
            return open_once, calls

        whole_open, _ = opener({})
        whole = _collect(ResumableCall(req, whole_open, 2, IngressMetrics()), loop)
        m = IngressMetrics()
        cut_open, calls = opener({0: 5})   # 4 deltas (engine steps), then the replica dies
        resumed = _collect(ResumableCall(req, cut_open, 2, m), loop)
        sent = calls[1]["resume_ids"]
        assert len(calls) == 2 and len(whole[0]) == 48 and len(resumed[0]) == 48 and 0 < len(sent) < 48
        assert resumed[0][: len(sent)] == sent == whole[0][: len(sent)]
        if temperature == 0 or reproducible:   # greedy and reproducible tokens are a function of the prefix
            assert resumed[0] == whole[0] and resumed[1] == whole[1]
        else:   # (the check has teeth: a fresh draw after the cut)
            assert resumed[0] != whole[0]
        assert resumed[2]["usage"]["completion_tokens"] == 48
        assert {s[0]: s[2] for s in m.snapshot()}["treespark:stream_resumes_total"] == 1
    finally:
        for c in cores:
            c.shutdown()
        loop.close()

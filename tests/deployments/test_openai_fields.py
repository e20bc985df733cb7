"""OpenAI fields: ``n`` > 1 (independent choices, seeds derived from the request's),
``logprobs`` / ``top_logprobs`` (one entry per generated token), a clear 400 for a field we
cannot honour, unknown fields ignored. In-process over the real
engine on the tiny random pair (``serving.inprocess``), and the official ``openai``
client over ASGI."""

from __future__ import annotations

import httpx2 as httpx  # what the openai client (3.x) is built on
import pytest
from serving.policies import LADDER

from deployments.config import AppArgs, LimitArgs
from deployments.http.validation import SEED_STRIDE, choice_requests, choice_seed

MODEL = "treespark-random"
ARGS = AppArgs(model="random", vocab_size=512, max_batch_size=4, max_context=128, policy=LADDER,
               limits=LimitArgs(max_tokens=16, max_n=3))


@pytest.fixture(scope="module")
def api():
    from serving.inprocess import LocalApi

    a = LocalApi(ARGS)
    yield a
    a.close()


def complete(api, **kw):
    return api.post("/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 8, **kw})


def chat(api, **kw):
    return api.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "abc"}],
                                             "max_tokens": 8, **kw})


def test_choice_seeds():
    assert choice_seed(None, 3) is None
    assert choice_seed(7, 0) == 7 and choice_seed(-5, 0) == -5
    assert choice_seed(7, 1) == (7 + SEED_STRIDE) % 2**64
    seeds = [choice_seed(2**64 - 1, i) for i in range(1, 50)]
    assert len(set(seeds)) == 49 and all(0 <= s < 2**64 for s in seeds)
    reqs = choice_requests({"request_id": "r0", "seed": 7, "prompt": "x"}, 3)
    assert [r["seed"] for r in reqs] == [choice_seed(7, i) for i in range(3)]
    assert len({r["request_id"] for r in reqs}) == 3 and reqs[0]["request_id"] == "r0"


def test_n_choices_seeded(api):
    r = complete(api, n=3, temperature=1.0, seed=11)
    assert r.status == 200, r.body
    body = r.json()
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len(set(texts)) > 1                                       # independent samples
    again = complete(api, n=3, temperature=1.0, seed=11).json()
    assert [c["text"] for c in again["choices"]] == texts             # reproducible
    one = complete(api, n=1, temperature=1.0, seed=11).json()
    assert one["choices"][0]["text"] == texts[0]                      # choice 0 uses the request's seed
    usage = body["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]    # the prompt counted once
    assert usage["completion_tokens"] == 3 * 8 and usage["total_tokens"] == usage["prompt_tokens"] + 24
    spec = body["speculation"]
    assert spec["rounds"] >= 3 and 0 <= spec["accepted_tokens"] <= usage["completion_tokens"] - spec["rounds"]  # summed


def test_n_choices_unseeded_and_greedy(api):
    r = complete(api, n=2, temperature=1.0)
    assert r.status == 200 and len(r.json()["choices"]) == 2
    greedy = complete(api, n=2, temperature=0.0).json()["choices"]
    assert greedy[0]["text"] == greedy[1]["text"]


def test_n_chat_stream(api):
    r = chat(api, n=2, temperature=1.0, seed=5, stream=True, stream_options={"include_usage": True})
    assert r.status == 200, r.body
    events = r.sse()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = {0: "", 1: ""}
    roles, finished = set(), set()
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        roles |= {i} if choice["delta"].get("role") == "assistant" else set()
        texts[i] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finished.add(i)
    assert roles == {0, 1} and finished == {0, 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    whole = chat(api, n=2, temperature=1.0, seed=5).json()
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]


def test_n_bounds(api):
    for n, msg in ((4, "n must be <= 3"), (0, "greater than or equal to 1")):
        r = complete(api, n=n)
        assert r.status == 400 and r.json()["error"]["param"] == "n" and msg in r.json()["error"]["message"], r.body


@pytest.mark.parametrize("route,field,value", [
    ("completions", "echo", True),
    ("completions", "best_of", 3),
    ("completions", "suffix", "end"),
    ("completions", "presence_penalty", 0.5),
    ("completions", "frequency_penalty", -1.0),
    ("completions", "logit_bias", {"17": 5.0}),
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "response_format", {"type": "json_object"}),
])
def test_unhonoured_fields_are_400(api, route, field, value):
    r = (complete if route == "completions" else chat)(api, **{field: value})
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter" and "not supported yet" in err["message"]


@pytest.mark.parametrize("route,extra", [
    ("completions", {"logprobs": None, "echo": False, "best_of": 1, "suffix": None, "presence_penalty": 0,
                     "logit_bias": {}, "user": "u-1"}),
    ("chat", {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
              "response_format": {"type": "text"}, "user": "u-1"}),
    ("completions", {"metadata": {"a": "b"}, "store": False, "some_future_field": [1, 2]}),   # unknown: ignored
])
def test_defaults_and_unknown_fields_change_nothing(api, route, extra):
    send = complete if route == "completions" else chat
    plain = send(api, temperature=0.0)
    r = send(api, temperature=0.0, **extra)
    assert r.status == 200, r.body
    key = "text" if route == "completions" else "message"
    assert r.json()["choices"][0][key] == plain.json()["choices"][0][key]


def test_openai_client_n(api):
    """The official client, over ASGI: n choices, and the 400 it raises for tools."""
    import asyncio

    import openai

    from deployments.http.api import app

    async def run():
        app.dependency_overrides[api._dep] = lambda: api.api
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)
        out = await client.completions.create(model=MODEL, prompt="abc", max_tokens=6, n=2, seed=3, temperature=1.0)
        with pytest.raises(openai.BadRequestError, match="not supported yet"):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, tools=[{"type": "function", "function": {"name": "f"}}])
        await http.aclose()
        return out

    out = api.loop.run_until_complete(asyncio.wait_for(run(), 60))
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 12


def openai_client(api, fn):
    """Run ``fn(client)`` with the official async client over ASGI."""
    import asyncio

    import openai

    from deployments.http.api import app

    async def run():
        app.dependency_overrides[api._dep] = lambda: api.api
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)
        try:
            return await fn(client)
        finally:
            await http.aclose()

    return api.loop.run_until_complete(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_client_chat_logprobs(api, temperature):
    """One entry per generated token, streamed or not; the same numbers both ways."""
    msgs = [{"role": "user", "content": "tell me"}]

    async def both(client):
        whole = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, logprobs=True,
                                                     top_logprobs=3, temperature=temperature, seed=4)
        stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, logprobs=True,
                                                      top_logprobs=3, temperature=temperature, seed=4, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return whole, chunks

    whole, chunks = openai_client(api, both)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 12
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6
        if temperature == 0:
            assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)   # greedy: the likeliest token
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs is not None for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # the same numbers to float rounding: the two requests' verify forwards may differ in
    # width (the policy's trees follow the replica's state), and the product plan may run
    # another layout at another row count (``treespark.kernels.linear.choose_plan``)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_openai_client_completion_logprobs(api):
    async def both(client):
        whole = await client.completions.create(model=MODEL, prompt="abc", max_tokens=10, logprobs=2,
                                                temperature=0.0)
        stream = await client.completions.create(model=MODEL, prompt="abc", max_tokens=10, logprobs=2,
                                                 temperature=0.0, stream=True)
        return whole, [c async for c in stream]

    whole, chunks = openai_client(api, both)
    lp = whole.choices[0].logprobs
    n = whole.usage.completion_tokens
    assert n == 10 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_logprobs_do_not_change_the_text(api):
    for send in (complete, chat):
        plain = send(api, temperature=1.0, seed=9).json()["choices"][0]
        with_lp = send(api, temperature=1.0, seed=9, **({"logprobs": 5} if send is complete else
                                                        {"logprobs": True, "top_logprobs": 5})).json()["choices"][0]
        key = "text" if send is complete else "message"
        assert with_lp[key] == plain[key] and plain["logprobs"] is None and with_lp["logprobs"] is not None


def test_top_logprobs_needs_logprobs(api):
    r = chat(api, top_logprobs=2)
    assert r.status == 400 and r.json()["error"]["param"] == "top_logprobs", r.body

"""From an engine replica's events to OpenAI responses: JSON bodies and SSE streams.

An engine replica's ``generate`` yields ``start``, ``delta`` ..., then ``end`` or
``error`` events (``deployments.replica.replica``); a request with ``n`` choices is ``n`` engine
requests. ``completion_body`` folds them into a ``text_completion`` or
``chat.completion`` object; ``sse_stream`` relays them as ``data:`` chunks (each naming
its choice's ``index``) ending in ``data: [DONE]``, an engine failure mid-stream as an
SSE error event naming an error id (the detail goes to the log).
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError

from deployments.http.errors import error_response, internal_error

log = logging.getLogger(__name__)


def cancel_call(gen: Any) -> None:
    """Cancel a handle call, best effort: Serve's ``cancel()`` re-raises the call's own error
    (BackPressureError, a dead actor) when it already failed."""
    if gen is not None:
        with contextlib.suppress(Exception):
            gen.cancel()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def engine_error_response(ev: dict[str, Any]) -> JSONResponse:
    """An engine ``error`` event as a response: 4xx as they are, 5xx by error id only."""
    if ev.get("code") == "replica_not_ready":  # a model that did not load: the operator's own reason, no traceback
        return error_response(503, ev["message"], ev["param"], ev["code"])
    if ev["status"] >= 500:  # the message may hold exception text: log it, answer an id
        return internal_error("the engine failed on this request", ev["message"], ev["status"], ev["code"] or "engine_error")
    return error_response(ev["status"], ev["message"], ev["param"], ev["code"])


def merge_speculation(ends: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's ``speculation`` from its choices' (sums; the means recomputed)."""
    if len(ends) == 1:
        return ends[0]["speculation"]
    specs = [e["speculation"] for e in ends]
    rounds = sum(s["rounds"] for s in specs)
    accepted = sum(s["accepted_tokens"] for s in specs)
    drafted = None if any(s["drafted_tokens"] is None for s in specs) else sum(s["drafted_tokens"] for s in specs)
    return {"rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "mean_tree_size": None if drafted is None else drafted / max(rounds, 1),
            "accepted_per_round": accepted / max(rounds, 1)}


def merge_usage(ends: list[dict[str, Any]]) -> dict[str, int]:
    """The prompt counted once, the completions of every choice."""
    prompt = ends[0]["usage"]["prompt_tokens"]
    completion = sum(e["usage"]["completion_tokens"] for e in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Chat's ``logprobs``: one content entry per token (``text.logprob_entry`` items)."""
    if entries is None:
        return None
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}
    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top"]]} for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]] | None, offset: int = 0) -> dict[str, Any] | None:
    """The completions ``logprobs`` (parallel lists, one entry per token); ``top_logprobs``
    holds the likeliest tokens and the chosen one; ``text_offset`` counts from ``offset``."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top"]}, e["token"]: e["logprob"]}
                             for e in entries],
            "text_offset": offsets}


def completion_body(rid: str, chat: bool, model: str,
                    choices: list[tuple[str, dict[str, Any], list[dict[str, Any]] | None]]) -> dict[str, Any]:
    """The non-streamed response, from each choice's whole text, ``end`` event and
    log-prob entries (None when not asked)."""
    ends = [end for _, end, _ in choices]
    base = {"id": rid, "created": int(time.time()), "model": model, "usage": merge_usage(ends),
            "speculation": merge_speculation(ends)}
    if chat:
        out = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": chat_logprobs(lps),
                "finish_reason": end["finish_reason"]} for i, (text, end, lps) in enumerate(choices)]
        return {"object": "chat.completion", **base, "choices": out}
    out = [{"index": i, "text": text, "logprobs": completion_logprobs(lps), "finish_reason": end["finish_reason"]}
           for i, (text, end, lps) in enumerate(choices)]
    return {"object": "text_completion", **base, "choices": out}


_DONE = object()


async def _indexed(gens: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """The events of several handle calls as (choice index, event), in arrival order; an
    exception in one (a dead replica) is raised here."""
    if len(gens) == 1:
        async for ev in gens[0]:
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Any) -> None:
        try:
            async for ev in gen:
                q.put_nowait((i, ev))
        except Exception as err:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, err))
        finally:
            q.put_nowait((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, item = await q.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


# what the client reads in a stream's error event, by its code (the detail goes to the log)
STREAM_ERRORS = {
    "replica_failed": "the engine replica serving this request failed",
}


async def sse_stream(gens: list[Any], rid: str, chat: bool, include_usage: bool, model: str,
                     on_error: Callable[[str], None] | None = None) -> AsyncIterator[str]:
    """The streamed response: ``gens`` (the calls of the request's choices, each past its
    first event: ``deployments.http.resume.ResumableCall``) as SSE lines; chunks carry their
    choice's index. A client that goes away before the end cancels every call (the
    replicas abort the requests). ``on_error(code)`` hears of every error event sent."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    offsets = [0] * len(gens)   # completions' text_offset, per choice

    def chunk(i: int, text: str | None, finish: str | None, role: bool = False,
              lps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            c = {"index": i, "delta": delta, "logprobs": chat_logprobs(lps), "finish_reason": finish}
        else:
            c = {"index": i, "text": text or "", "logprobs": completion_logprobs(lps, offsets[i]),
                 "finish_reason": finish}
            offsets[i] += sum(len(e["token"]) for e in lps or ())
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}

    def error(what: str, detail: Any, code: str) -> str:
        if on_error is not None:
            on_error(code)
        eid = uuid.uuid4().hex[:12]
        log.error("stream %s: %s [error id %s]: %s", rid, what, eid, detail)
        return sse({"error": {"message": f"{what} (error id {eid})", "type": "internal_error", "param": None, "code": code}})

    ends: dict[int, dict[str, Any]] = {}
    finished = False
    try:
        if chat:
            for i in range(len(gens)):
                yield sse(chunk(i, None, None, role=True))
        try:
            async with contextlib.aclosing(_indexed(gens)) as events:
                async for i, ev in events:
                    if ev["type"] == "delta" and (ev["text"] or ev.get("logprobs")):
                        yield sse(chunk(i, ev["text"], None, lps=ev.get("logprobs")))
                    elif ev["type"] == "end":
                        ends[i] = ev
                        yield sse(chunk(i, None if chat else "", ev["finish_reason"]))
                        if len(ends) == len(gens):
                            finished = True
                            if include_usage:
                                done = [ends[j] for j in range(len(gens))]
                                yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                           "usage": merge_usage(done), "speculation": merge_speculation(done)})
                    elif ev["type"] == "error":  # final for its choice; the others are cancelled below
                        finished = len(gens) == 1
                        code = ev["code"] or "engine_error"
                        yield error(STREAM_ERRORS.get(code, "the engine failed on this request"), ev["message"], code)
                        break
        except RayActorError as err:  # the replica died mid-stream: tell the client, end cleanly
            finished = len(gens) == 1
            yield error("the engine replica serving this request failed", repr(err)[:2000], "replica_failed")
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # client disconnected, or a choice failed: abort the others in the engines
            for gen in gens:
                cancel_call(gen)

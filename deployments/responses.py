"""From an engine replica's events to OpenAI responses: JSON bodies and SSE streams.

An engine replica's ``generate`` yields ``start``, ``delta`` ..., then ``end`` or
``error`` events (``deployments.replica``). ``completion_body`` folds them into a
``text_completion`` or ``chat.completion`` object; ``sse_stream`` relays them as
``data:`` chunks ending in ``data: [DONE]``, an engine failure mid-stream as an SSE
error event naming an error id (the detail goes to the log).
"""

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError

from deployments.errors import error_response, internal_error

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
    if ev["status"] >= 500:  # the message may hold exception text: log it, answer an id
        return internal_error("the engine failed on this request", ev["message"], ev["status"], ev["code"] or "engine_error")
    return error_response(ev["status"], ev["message"], ev["param"], ev["code"])


def completion_body(rid: str, chat: bool, model: str, text: str, end: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed response, from the whole text and the ``end`` event."""
    base = {"id": rid, "created": int(time.time()), "model": model, "usage": end["usage"], "speculation": end["speculation"]}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": end["finish_reason"]}
        return {"object": "chat.completion", **base, "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": end["finish_reason"]}
    return {"object": "text_completion", **base, "choices": [choice]}


async def sse_stream(gen: Any, rid: str, chat: bool, include_usage: bool, model: str) -> AsyncIterator[str]:
    """The streamed response: ``gen`` (the handle call, past its first event) as SSE lines.
    A client that goes away before the end cancels ``gen`` (the replica aborts the request)."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}

    def error(what: str, detail: Any, code: str) -> str:
        eid = uuid.uuid4().hex[:12]
        log.error("stream %s: %s [error id %s]: %s", rid, what, eid, detail)
        return sse({"error": {"message": f"{what} (error id {eid})", "type": "internal_error", "param": None, "code": code}})

    finished = False
    try:
        if chat:
            yield sse(chunk(None, None, role=True))
        try:
            async for ev in gen:
                if ev["type"] == "delta" and ev["text"]:
                    yield sse(chunk(ev["text"], None))
                elif ev["type"] == "end":
                    finished = True
                    yield sse(chunk(None if chat else "", ev["finish_reason"]))
                    if include_usage:
                        yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                   "usage": ev["usage"], "speculation": ev["speculation"]})
                elif ev["type"] == "error":
                    finished = True
                    yield error("the engine failed on this request", ev["message"], ev["code"] or "engine_error")
        except RayActorError as err:  # the replica died mid-stream: tell the client, end cleanly
            finished = True
            yield error("the engine replica serving this request failed", repr(err)[:2000], "replica_failed")
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # client disconnected (or we failed): abort in the engine
            cancel_call(gen)

"""Engine requests that outlive their replica: re-issued elsewhere, replayed past what was sent.

Decoding is deterministic given a request's prompt, parameters and seed (the ingress
gives every sampled request a seed), so the same request re-issued to another engine
replica generates the same tokens again. ``ResumableCall`` is one engine request as one
event stream (``start``, ``delta`` ..., then ``end`` or ``error``) that hides a replica
failure from its reader: it re-issues the request under a new request id with the same
seed, drops the replayed events up to what the reader already has (``Replay``), checks
on the way that they match it (token ids, and text), and goes on with the new ones. The
reader sees one ``start``, deltas without repeats and one ``end``, whose usage counts
every token once (the last replica generated them all).

A replica *failed* under a call when

* its handle call raises ``RayActorError`` (Ray Serve's handle surfaces a dead or
  unreachable replica actor as ``ActorDiedError`` or ``ActorUnavailableError``, its two
  subclasses; a scale-down drain that outlasts Serve's graceful shutdown timeout ends
  with the actor killed, the same way), or
* it answers an ``error`` event with code ``replica_stopping`` (its engine loop stopped
  under the request: the replica is going away).

A replay that differs from what was sent ends the call with an ``error`` event
``resume_mismatch`` (it must not happen; if it does, continuing would corrupt the text the
client has); a call whose replicas failed more than ``retries`` times ends with
``replica_failed``. Every re-issue costs a whole generation up to the cut on the new
replica, so the bound keeps one request that keeps losing replicas (or kills them: a
poison request) from taking the fleet down with it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError

from deployments.http.errors import error_response, retry_after
from deployments.http.responses import cancel_call
from deployments.metrics import IngressMetrics

log = logging.getLogger(__name__)

REPLICA_STOPPING = "replica_stopping"   # an engine replica's error code: its engine loop stopped


class ReplicaFailed(Exception):
    """The engine replica under a call died or is going away (the cause is chained)."""


class ReplayMismatch(Exception):
    """A re-issued request's replay differs from what its reader already has."""


def stopping(ev: dict[str, Any]) -> bool:
    return ev["type"] == "error" and ev.get("code") == REPLICA_STOPPING


def error_event(code: str, message: str, status: int = 503) -> dict[str, Any]:
    return {"type": "error", "status": status, "message": message, "param": None, "code": code}


@dataclass
class Replay:
    """Drops a re-issued request's deltas up to ``sent_ids`` / ``sent_text`` (what the reader
    has), raising ``ReplayMismatch`` where they differ. Token ids are compared when the
    events carry them (``sent_ids`` is None when they did not); text always."""

    sent_ids: list[int] | None
    sent_text: str
    ids_seen: int = 0
    text_seen: int = 0

    @property
    def caught_up(self) -> bool:
        return (self.sent_ids is None or self.ids_seen >= len(self.sent_ids)) and self.text_seen >= len(self.sent_text)

    def feed(self, ev: dict[str, Any]) -> dict[str, Any]:
        """The delta ``ev`` less what was sent already (possibly empty)."""
        out = dict(ev)
        ids = ev.get("token_ids")
        if self.sent_ids is not None and ids is not None:
            n = _already_sent(list(ids), self.sent_ids, self.ids_seen, "token ids", "output position")
            self.ids_seen += len(ids)
            out["token_ids"] = list(ids)[n:]
            if ev.get("logprobs") is not None:   # one entry per token
                out["logprobs"] = ev["logprobs"][n:]
        text = ev["text"]
        n = _already_sent(text, self.sent_text, self.text_seen, "text", "character")
        self.text_seen += len(text)
        out["text"] = text[n:]
        return out


# (the handle call, its first event) | the refusal; raises ReplicaFailed
Opener = Callable[[dict[str, Any]], Awaitable[tuple[Any, dict[str, Any]] | JSONResponse]]


@dataclass
class ResumableCall:
    """One engine request ``ereq`` through ``open_once`` (one attempt on one replica), re-issued
    up to ``retries`` times when its replica fails, before or after its first event. ``open``
    first; then iterate its events after ``start`` (``start``: the first attempt's).
    ``stream``: the reader relays the events as they come (counted as stream resumes);
    ``retry_after_s``: the Retry-After of the 503 when no attempt got started."""

    ereq: dict[str, Any]
    open_once: Opener
    retries: int
    metrics: IngressMetrics
    stream: bool = True
    retry_after_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    start: dict[str, Any] | None = None
    _gen: Any = None
    _first: dict[str, Any] | None = None
    _events: AsyncIterator[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        assert self.start is not None
        return self.start["request_id"]

    async def open(self) -> JSONResponse | None:
        """Start the request on some replica: None once it started, or the refusal to answer
        (a 503 ``replica_failed`` when every attempt's replica failed first)."""
        opened = await self._attempt(self.ereq)
        if isinstance(opened, JSONResponse):
            return opened
        self._gen, self.start = opened
        self._events = self._run()
        return None

    async def _attempt(self, ereq: dict[str, Any]) -> tuple[Any, dict[str, Any]] | JSONResponse:
        """``open_once``, re-issued under a new id while the replica fails before the first
        event (each re-issue is one of the call's ``retries``)."""
        while True:
            try:
                opened = await self.open_once(ereq)
            except ReplicaFailed:
                opened = None
            if isinstance(opened, JSONResponse):
                return opened
            if opened is not None:
                if not stopping(opened[1]):
                    return opened
                cancel_call(opened[0])
            if self.retries <= 0:
                return error_response(503, "the engine replica serving this request failed; retry",
                                      code="replica_failed", headers=retry_after(self.retry_after_s))
            self.retries -= 1
            self.metrics.retried()
            ereq = {**ereq, "request_id": uuid.uuid4().hex}

    def __aiter__(self) -> ResumableCall:
        return self

    async def __anext__(self) -> dict[str, Any]:
        assert self._events is not None, "open() first"
        return await self._events.__anext__()

    def cancel(self) -> None:
        """Cancel the handle call under way (the reader went away)."""
        cancel_call(self._gen)

    async def _run(self) -> AsyncIterator[dict[str, Any]]:
        sent_ids: list[int] | None = []   # what the reader has (None: the events carry no ids)
        sent_text: list[str] = []
        replay: Replay | None = None       # after a re-issue: until it caught up with the above
        failed_at = 0.0
        while True:
            try:
                async for ev in self._gen:
                    if stopping(ev):
                        raise ReplicaFailed(ev["message"])
                    if replay is not None:
                        if ev["type"] == "delta" and not replay.caught_up:
                            ev = replay.feed(ev)
                        elif ev["type"] == "end" and not replay.caught_up:
                            raise ReplayMismatch(f"the replay ended after {replay.ids_seen} tokens, "
                                                 f"{replay.text_seen} characters")
                        if replay.caught_up:   # the client is where it was before the failure
                            if self.stream:
                                self.metrics.resumed(self.clock() - failed_at)
                            replay = None
                    if ev["type"] == "delta":
                        if ev.get("token_ids") is None:
                            sent_ids = None
                        elif sent_ids is not None:
                            sent_ids += ev["token_ids"]
                        sent_text.append(ev["text"])
                    yield ev
                    if ev["type"] in ("end", "error"):
                        return
                return   # ended without an end event: the reader says so
            except ReplayMismatch as err:
                cancel_call(self._gen)
                log.error("request %s: the replay on another replica differed: %s", self.ereq["request_id"], err)
                yield error_event("resume_mismatch", f"the replay on another replica differed: {err}", 500)
                return
            except (RayActorError, ReplicaFailed) as err:
                cancel_call(self._gen)
                log.warning("request %s: engine replica failed after %d characters (%r); %d re-issues left",
                            self.ereq["request_id"], sum(map(len, sent_text)), err, self.retries)
            failed_at = self.clock()
            if self.retries <= 0:
                yield error_event("replica_failed", "the engine replica serving this request failed "
                                                    "(no re-issue left)")
                return
            self.retries -= 1
            self.metrics.retried()
            opened = await self._attempt({**self.ereq, "request_id": uuid.uuid4().hex})
            if isinstance(opened, JSONResponse):
                yield error_event("replica_failed", "the engine replica serving this request failed and no "
                                                    f"other replica took it over ({opened.status_code})")
                return
            self._gen, first = opened
            if first["type"] == "error":   # the engine refused the replay (it took the original)
                yield first
                return
            replay = Replay(None if sent_ids is None else list(sent_ids), "".join(sent_text))


def _already_sent(new: Sequence, sent: Sequence, seen: int, what: str, unit: str) -> int:
    """How many leading items of ``new`` (ids or characters; ``seen`` of ``sent`` were
    replayed before it) the client already has; raises ``ReplayMismatch`` if they differ."""
    old = new[: max(len(sent) - seen, 0)]
    if old != sent[seen: seen + len(old)]:
        raise ReplayMismatch(f"{what} {old!r} at {unit} {seen}, sent {sent[seen: seen + len(old)]!r}")
    return len(old)

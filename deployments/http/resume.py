"""Engine requests that outlive their replica: re-issued elsewhere, continued after what was sent.

``ResumableCall`` is one engine request as one event stream (``start``, ``delta`` ...,
then ``end`` or ``error``) that hides a replica failure from its reader: it re-issues the
request under a new request id to another replica with ``resume_ids``, the token ids the
reader already has, and that replica continues the generation after them
(``deployments.replica.core``: it prefills prompt + those tokens and generates the rest).
The reader sees one ``start``, the deltas without gap or repeat, and one ``end``, whose
usage counts every token once.

What the continuation generates is what the first replica would have: at T = 0, and at
T > 0 for a request whose client sent a seed (``reproducible``: its tokens are keyed by
(seed, index), ``treespark.spec.gumbel``), the same tokens, a function of the prefix and
the seed; for another sampled request a draw from the target's distribution given the
prefix (its draws depended on its draft trees, so no replica could repeat them;
``docs/stream-resume.md``). The re-issued request keeps the first one's parameters, its
seed and switch included.

A replica *failed* under a call when

* its handle call raises ``RayActorError`` (Ray Serve's handle surfaces a dead or
  unreachable replica actor as ``ActorDiedError`` or ``ActorUnavailableError``, its two
  subclasses; a scale-down drain that outlasts Serve's graceful shutdown timeout ends
  with the actor killed, the same way), or
* it answers an ``error`` event with code ``replica_stopping`` (its engine loop stopped
  under the request: the replica is going away).

A call whose replicas failed more than ``retries`` times ends with ``replica_failed``:
the bound keeps one request that keeps losing replicas (or kills them: a poison request)
from taking the fleet down with it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
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


def stopping(ev: dict[str, Any]) -> bool:
    return ev["type"] == "error" and ev.get("code") == REPLICA_STOPPING


def error_event(code: str, message: str, status: int = 503) -> dict[str, Any]:
    return {"type": "error", "status": status, "message": message, "param": None, "code": code}


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
        sent: list[int] = []              # the token ids the reader has
        failed_at: float | None = None    # a re-issued call's failure, until its first event
        while True:
            try:
                async for ev in self._gen:
                    if stopping(ev):
                        raise ReplicaFailed(ev["message"])
                    if failed_at is not None and self.stream:
                        self.metrics.resumed(self.clock() - failed_at)
                    failed_at = None
                    if ev["type"] == "delta":
                        sent += ev["token_ids"]
                    yield ev
                    if ev["type"] in ("end", "error"):
                        return
                return   # ended without an end event: the reader says so
            except (RayActorError, ReplicaFailed) as err:
                cancel_call(self._gen)
                log.warning("request %s: engine replica failed after %d tokens (%r); %d re-issues left",
                            self.ereq["request_id"], len(sent), err, self.retries)
            failed_at = self.clock()
            if self.retries <= 0:
                yield error_event("replica_failed", "the engine replica serving this request failed "
                                                    "(no re-issue left)")
                return
            self.retries -= 1
            self.metrics.retried()
            opened = await self._attempt({**self.ereq, "request_id": uuid.uuid4().hex, "resume_ids": list(sent)})
            if isinstance(opened, JSONResponse):
                yield error_event("replica_failed", "the engine replica serving this request failed and no "
                                                    f"other replica took it over ({opened.status_code})")
                return
            self._gen, first = opened
            if first["type"] == "error":   # the other replica refused the continuation
                yield first
                return

"""The engine replica without Serve: ``ReplicaCore``, continuous batching per request.

The core owns an ``EngineLoop`` (the engine in its own thread) so concurrent requests
join the running batch. ``generate`` is an async generator of small event dicts that
the API turns into OpenAI responses:

* ``{"type": "error", "status", "message", "param", "code"}``   (bad input; final; code
  ``replica_stopping`` when the engine loop stopped under the request: the API resumes it
  on another replica)
* ``{"type": "start", "request_id", "prompt_tokens"}``
* ``{"type": "delta", "text", "token_ids"}``                    (one per engine step; with
  ``"logprobs"``, one ``text.logprob_entry`` per token, when the request asked)
* ``{"type": "end", "finish_reason", "usage", "speculation"}``  (final)

A request may carry ``resume_ids``: the tokens an earlier replica already generated for
it (the API sends them when that replica failed mid-generation,
``deployments.http.resume``). The core then continues the generation after them: the
engine prefills prompt + resumed tokens and generates the rest of ``max_tokens``; the
deltas carry only the new text (the detokenizer and the stop strings have seen the
resumed tokens), and the usage counts the resumed tokens as generated.

Each request is timed and counted in the replica's Prometheus registry
(``deployments.metrics.ReplicaMetrics``), which the heartbeat reports.

Tokenization, the context check and stop strings happen here, where the tokenizer is.
The controller link (reports, budget, calibration) is its ``Heartbeat``
(``deployments.replica.heartbeat``).

A replica whose model cannot be loaded (``treespark.models.errors.ModelLoadError``: a bad
path, a refused drafter checkpoint) logs the reason in one line and stays up without an
engine: restarting cannot fix its configuration, so instead of a crash loop it reports
``startup_error`` in its status and answers every request 503 with that reason.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.config import AppArgs, import_attr
from deployments.metrics import ReplicaMetrics, RequestClock
from deployments.replica.engine_factory import EngineBundle
from deployments.replica.engine_loop import (
    ACCEPTED,
    SCHEDULED,
    Aborted,
    EngineLoop,
    Failed,
    LoopStopped,
    asyncio_sink,
)
from deployments.replica.heartbeat import Heartbeat, ReplicaCounters, rss_bytes
from deployments.replica.text import Detokenizer, StopMatcher, encode_text, logprob_entry
from deployments.reports import COUNTERS
from treespark.models.chat import chat_ids
from treespark.models.errors import ModelLoadError
from treespark.spec.calibration import Calibration

log = logging.getLogger(__name__)


def _build_bundle(args: AppArgs) -> EngineBundle:
    """Runs on the engine loop thread: torch's thread count, then the engine factory."""
    if args.replica.torch_threads:
        import torch

        torch.set_num_threads(args.replica.torch_threads)
    return import_attr(args.engine_factory)(args)


class _NoEngine:
    """What a replica that could not load its model holds instead of an engine."""

    vocab_size = 0
    calibration = Calibration()


def without_paths(message: str) -> str:
    """``message`` with each absolute file path cut to its last component: a 5xx body tells
    the client why, never where the server's files are (the log and the status keep it)."""
    return re.sub(r"(?<![\w.])/(?:[^\s'\"/]+/)+([^\s'\"/]*)", r".../\1", message)


def _error(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> dict[str, Any]:
    return {"type": "error", "status": status, "message": message, "param": param, "code": code}


def _failed(error: BaseException) -> dict[str, Any]:
    """The error event of an engine failure under a running request."""
    if isinstance(error, LoopStopped):
        return _error(f"the engine loop stopped: {error}", status=503, code="replica_stopping")
    return _error(f"engine error: {error}", status=500, code="engine_error")


class ReplicaCore:
    """The replica without Serve: engine loop, request handling, heartbeat. ``replica_id``
    names it to the controller; ``connect`` returns a controller handle (Ray in production)."""

    def __init__(self, args: AppArgs, replica_id: str, connect: Callable[[], Any] | None = None,
                 node_id: str | None = None) -> None:
        self.args = args
        self.replica_id = replica_id
        self.node_id = node_id  # the Ray node, reported to the controller
        # The engine is built on the thread that runs it, so torch keeps one OpenMP
        # worker team (see deployments.replica.engine_loop).
        self.loop = EngineLoop().start()
        self.startup_error: str | None = None
        try:
            bundle: EngineBundle = self.loop.call(lambda: _build_bundle(args))
            self.loop.attach(bundle.engine)
        except ModelLoadError as err:  # one line, no traceback; the replica stays up and says why
            self.startup_error = (str(err).strip().splitlines() or [type(err).__name__])[0]
            log.error("replica %s cannot serve: %s", replica_id, self.startup_error)
            bundle = EngineBundle(engine=_NoEngine(), tokenizer=None, make_params=dict)
            connect = None  # not registered with the controller: it takes no share of the load
        except BaseException:
            self.loop.stop()
            raise
        self.bundle = bundle
        self.tokenizer = bundle.tokenizer
        self.vocab_size = int(bundle.engine.vocab_size)
        self.counters = ReplicaCounters(COUNTERS)
        self.metrics = ReplicaMetrics()
        self.heartbeat = Heartbeat(args=args, replica_id=replica_id, node_id=node_id,
                                   policy=args.policy.build(args.max_batch_size), loop=self.loop,
                                   bundle=bundle, counters=self.counters, metrics=self.metrics,
                                   connect=connect)

    # -- requests ------------------------------------------------------------
    def _prompt_ids(self, req: dict[str, Any]) -> list[int] | dict[str, Any]:
        param = "messages" if req.get("messages") is not None else "prompt"
        try:
            if req.get("messages") is not None:
                ids = chat_ids(self.tokenizer, req["messages"])
            elif req.get("prompt_ids") is not None:
                ids = [int(t) for t in req["prompt_ids"]]
            else:
                ids = encode_text(self.tokenizer, req.get("prompt") or "")
        except Exception as err:  # noqa: BLE001 - a template or tokenizer rejecting the input
            return _error(f"could not tokenize the {param}: {err}", param)
        if not ids:
            return _error(f"the {param} is empty", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            return _error(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param)
        return ids

    def _params(self, req: dict[str, Any], n_prompt: int, resumed: int = 0) -> Any:
        """The request's ``SamplingParams``, its ``max_tokens`` less the ``resumed`` tokens
        already generated (an int <= 0 instead where nothing is left to generate)."""
        room = self.args.max_context - n_prompt
        param = "messages" if req.get("messages") is not None else "prompt"
        if room < 1:
            return _error(
                f"This model's maximum context length is {self.args.max_context} tokens; the prompt has {n_prompt}.",
                param,
                "context_length_exceeded",
            )
        max_tokens = req.get("max_tokens")
        if max_tokens is None:
            max_tokens = min(self.args.default_max_tokens, room)
        if max_tokens > room:
            return _error(
                f"This model's maximum context length is {self.args.max_context} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion).",
                "max_tokens",
                "context_length_exceeded",
            )
        stop_ids = tuple(int(t) for t in req.get("stop_token_ids") or ())
        if not req.get("ignore_eos"):
            stop_ids += tuple(t for t in self.bundle.eos_token_ids if t not in stop_ids)
        left = int(max_tokens) - resumed
        if left < 1:
            return left
        try:
            return self.bundle.make_params(
                temperature=float(req.get("temperature", 0.0)),
                top_p=float(req.get("top_p", 1.0)),
                max_tokens=left,
                stop_token_ids=stop_ids,
                seed=req.get("seed"),
                reproducible=bool(req.get("reproducible", False)),
                logprobs=req.get("logprobs"),
            )
        except ValueError as err:
            return _error(str(err))

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        if self.startup_error is not None:
            yield _error(f"this engine replica cannot serve: {without_paths(self.startup_error)}",
                         code="replica_not_ready", status=503)
            return
        clock = self.metrics.request()
        ids = self._prompt_ids(req)
        if isinstance(ids, dict):
            yield ids
            return
        resumed = [int(t) for t in req.get("resume_ids") or ()]
        params = self._params(req, len(ids), len(resumed))
        if isinstance(params, dict):
            yield params
            return
        rid = req.get("request_id") or uuid.uuid4().hex
        detok = Detokenizer(self.tokenizer)
        stops = StopMatcher(req.get("stop") or ())
        _, hit = stops.feed(detok.push(resumed))   # (sent already, but for the held-back tail)
        if isinstance(params, int) or hit or (resumed and resumed[-1] in params.stop_token_ids):
            # the earlier replica had generated everything and failed before its end event
            yield {"type": "start", "request_id": rid, "prompt_tokens": len(ids)}
            reason = "length" if isinstance(params, int) and not hit else "stop"
            yield self._end(rid, reason, len(ids), 0, 0, None, clock, resumed=len(resumed))
            return
        q: asyncio.Queue = asyncio.Queue()
        self.loop.add(rid, ids + resumed, params, asyncio_sink(q, asyncio.get_running_loop()))
        done = False
        generated, rounds = 0, 0
        try:
            first = await q.get()
            while first is SCHEDULED:  # (not before ACCEPTED, but cheap to be sure)
                clock.scheduled()
                first = await q.get()
            if isinstance(first, Failed):
                done = True
                yield _error(str(first.error)) if isinstance(first.error, ValueError) else _failed(first.error)
                return
            assert first is ACCEPTED
            yield {"type": "start", "request_id": rid, "prompt_tokens": len(ids)}
            stopped_by_string = False
            while True:
                item = await q.get()
                if item is SCHEDULED:
                    clock.scheduled()
                    continue
                if isinstance(item, Failed):
                    done = True
                    yield _failed(item.error)
                    return
                if isinstance(item, Aborted):  # our own abort after a stop string
                    done = True
                    yield self._end(rid, "stop", len(ids), generated, rounds, None, clock, len(resumed))
                    return
                if stopped_by_string and not item.finished:  # in flight before our abort landed
                    continue
                new = list(item.new_token_ids)
                if new:
                    generated += len(new)
                    rounds += 1
                    clock.emitted(len(new))
                    self.counters.emitted(len(new))
                    text, hit = stops.feed(detok.push(new))
                    if item.finished and not hit:
                        text += stops.flush()
                    if text or new:
                        delta = {"type": "delta", "text": text, "token_ids": new}
                        if getattr(item, "logprobs", None) is not None:
                            delta["logprobs"] = [logprob_entry(self.tokenizer, x) for x in item.logprobs]
                        yield delta
                    if hit and not item.finished:
                        stopped_by_string = True
                        self.loop.abort(rid)
                        continue
                    if hit:
                        stopped_by_string = True
                if item.finished:
                    done = True
                    reason = "stop" if stopped_by_string else (item.finish_reason or "stop")
                    yield self._end(rid, reason, len(ids), generated, rounds, item.stats, clock, len(resumed))
                    return
        finally:
            if not done:  # the caller went away (client disconnect): free the KV now
                self.loop.abort(rid)
                self.counters.add(requests_aborted=1, prompt_tokens=len(ids))
                clock.aborted(len(ids))

    def _end(self, rid: str, reason: str, n_prompt: int, generated: int, rounds: int, stats: Any,
             clock: RequestClock, resumed: int = 0) -> dict[str, Any]:
        """The end event; its usage counts the ``resumed`` tokens of an earlier replica too."""
        self.counters.add(requests=1, prompt_tokens=n_prompt)
        clock.finished(reason, n_prompt)
        if stats is not None:
            spec = {
                "rounds": stats.rounds,
                "drafted_tokens": stats.drafted_tokens,
                "accepted_tokens": stats.accepted_tokens,
                "mean_tree_size": stats.mean_tree_size,
                "accepted_per_round": stats.accepted_tokens / max(stats.rounds, 1),
            }
            generated = stats.generated_tokens
        else:  # stopped by a stop string: the engine's stats went with the abort
            spec = {"rounds": rounds, "drafted_tokens": None, "accepted_tokens": max(generated - rounds, 0),
                    "mean_tree_size": None, "accepted_per_round": max(generated - rounds, 0) / max(rounds, 1)}
        generated += resumed
        usage = {"prompt_tokens": n_prompt, "completion_tokens": generated, "total_tokens": n_prompt + generated}
        return {"type": "end", "request_id": rid, "finish_reason": reason, "usage": usage, "speculation": spec}

    def status(self) -> dict[str, Any]:
        load = self.loop.load
        return {
            "replica_id": self.replica_id,
            **self.heartbeat.status(),
            "running": load.running,
            "waiting": load.waiting,
            "kv_cache_usage": load.kv_usage,
            "rss_bytes": rss_bytes(),
            "engine_alive": load.alive and self.startup_error is None,
            "startup_error": None if self.startup_error is None else without_paths(self.startup_error),
            "steps": self.loop.steps,
        }

    def shutdown(self) -> None:
        self.heartbeat.stop()
        self.loop.stop()

"""The engine replica: one ``Engine`` per Serve replica, continuous batching over HTTP.

Each replica owns an ``EngineLoop`` (the engine in its own thread) so concurrent
requests join the running batch. ``generate`` is an async generator of small event
dicts that the API turns into OpenAI responses:

* ``{"type": "error", "status", "message", "param", "code"}``   (bad input; final)
* ``{"type": "start", "request_id", "prompt_tokens"}``
* ``{"type": "delta", "text", "token_ids"}``                    (one per engine step)
* ``{"type": "end", "finish_reason", "usage", "speculation"}``  (final)

A heartbeat thread reports load and tree statistics to the controller every
``heartbeat_s`` and applies the budget in the reply. If the controller cannot be
reached, the replica prices its own speculation with the local policy from its own
load, and keeps trying (re-creating the controller if it is gone for good); the
controller registers it again on the first report that gets through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from deployments.config import AppArgs, import_attr
from deployments.controller import COUNTERS, TreeStats, budget_from_wire, budget_to_wire
from deployments.engine_loop import ACCEPTED, Aborted, EngineLoop, Failed, asyncio_sink
from deployments.text import ByteTokenizer, Detokenizer, StopMatcher, encode_chat, encode_text
from treespark.budget import Budget
from treespark.policy import LoadSnapshot

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class EngineBundle:
    """What an ``engine_factory`` returns: the engine, a tokenizer (HF or ``ByteTokenizer``),
    the ``SamplingParams`` constructor, and the token ids that end a generation."""

    engine: Any
    tokenizer: Any
    make_params: Callable[..., Any]
    eos_token_ids: tuple[int, ...] = ()


def load_model_pair(args: AppArgs) -> Any:
    import treespark

    if args.model == "random":
        return treespark.random_pair(vocab_size=args.vocab_size, seed=args.seed, device=args.device)
    if args.model == "default":
        return treespark.load_pair(device=args.device, progress=False)
    # A target/drafter pair by id (e.g. Qwen/Qwen3-4B + deepseek-ai/dspark_qwen3_4b_block7).
    return treespark.load_pair(target=args.model, drafter=args.drafter, device=args.device)


def build_engine(args: AppArgs) -> EngineBundle:
    """The default ``engine_factory``: the real engine on the configured model pair
    (the pair decides the device)."""
    from treespark.engine import Engine, EngineConfig, SamplingParams

    pair = load_model_pair(args)
    engine = Engine(pair, EngineConfig(max_batch_size=args.max_batch_size, max_context=args.max_context))
    tok = getattr(pair, "tokenizer", None)
    eos: tuple[int, ...] = ()
    if tok is None:
        tok = ByteTokenizer(engine.vocab_size)
    elif getattr(tok, "eos_token_id", None) is not None:
        eos = (int(tok.eos_token_id),)
    return EngineBundle(engine=engine, tokenizer=tok, make_params=SamplingParams, eos_token_ids=eos)


def summarize_steps(stats: list[Any]) -> TreeStats:
    """Means of the engine's ``StepStats`` over one heartbeat window."""
    if not stats:
        return TreeStats()
    n = len(stats)
    rows = [x for s in stats for x in range(s.batch_size)]
    nrows = max(len(rows), 1)

    def mean_rows(attr: str) -> float:
        return sum(sum(getattr(s, attr)) for s in stats) / nrows

    return TreeStats(
        steps=n,
        batch_size=sum(s.batch_size for s in stats) / n,
        mean_tree_size=mean_rows("tree_sizes"),
        mean_width=mean_rows("widths"),
        mean_depth=mean_rows("depths"),
        accepted_per_round=mean_rows("accepted"),
        step_s=sum(s.step_s for s in stats) / n,
        draft_s=sum(s.draft_s for s in stats) / n,
        verify_s=sum(s.verify_s for s in stats) / n,
        theta=stats[-1].theta,
    )


def _logit(q: float) -> float:
    """Calibration records travel as (logit q, accepted): the controller fits
    sigmoid(a * logit q + b), the map the engine's ``Calibration`` applies."""
    q = min(max(q, 1e-6), 1 - 1e-6)
    return math.log(q) - math.log1p(-q)


def rss_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _error(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> dict[str, Any]:
    return {"type": "error", "status": status, "message": message, "param": param, "code": code}


class ReplicaCore:
    """The replica without Serve: engine loop, request handling, heartbeat. ``replica_id``
    names it to the controller; ``connect`` returns a controller handle (Ray in production)."""

    def __init__(self, args: AppArgs, replica_id: str, connect: Callable[[], Any] | None = None) -> None:
        self.args = args
        self.replica_id = replica_id
        bundle: EngineBundle = import_attr(args.engine_factory)(args)
        self.bundle = bundle
        self.tokenizer = bundle.tokenizer
        self.vocab_size = int(bundle.engine.vocab_size)
        self.policy = args.policy.build(args.max_batch_size)
        self.loop = EngineLoop(bundle.engine).start()
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0.0)
        self._tokens_emitted = 0
        self.budget: Budget = self.policy.budget_for(LoadSnapshot.idle(), replica_id)
        self.budget_source = "local"
        self.loop.set_budget(self.budget)
        self.calibration: tuple[float, float] | None = None
        cal = getattr(bundle.engine, "calibration", None)
        if hasattr(cal, "a") and hasattr(cal, "b"):
            cal = (cal.a, cal.b)
        self.base_calibration = (float(cal[0]), float(cal[1])) if isinstance(cal, (tuple, list)) and len(cal) == 2 else None
        self.controller_ok = False
        self.registrations = 0
        self.heartbeats_ok = 0
        self.heartbeats_failed = 0
        self.last_heartbeat_error: str | None = None
        self.last_tree = TreeStats()
        self._connect = connect
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, name="treespark-heartbeat", daemon=True)
        if connect is not None:
            self._hb.start()

    # -- requests ------------------------------------------------------------
    def _prompt_ids(self, req: dict[str, Any]) -> list[int] | dict[str, Any]:
        param = "messages" if req.get("messages") is not None else "prompt"
        try:
            if req.get("messages") is not None:
                ids = encode_chat(self.tokenizer, req["messages"])
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

    def _params(self, req: dict[str, Any], n_prompt: int) -> Any:
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
        try:
            return self.bundle.make_params(
                temperature=float(req.get("temperature", 0.0)),
                top_p=float(req.get("top_p", 1.0)),
                max_tokens=int(max_tokens),
                stop_token_ids=stop_ids,
                seed=req.get("seed"),
            )
        except ValueError as err:
            return _error(str(err))

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        ids = self._prompt_ids(req)
        if isinstance(ids, dict):
            yield ids
            return
        params = self._params(req, len(ids))
        if isinstance(params, dict):
            yield params
            return
        rid = req.get("request_id") or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self.loop.add(rid, ids, params, asyncio_sink(q, asyncio.get_running_loop()))
        done = False
        generated, rounds = 0, 0
        detok = Detokenizer(self.tokenizer)
        stops = StopMatcher(req.get("stop") or ())
        try:
            first = await q.get()
            if isinstance(first, Failed):
                done = True
                if isinstance(first.error, ValueError):
                    yield _error(str(first.error))
                else:
                    yield _error(f"engine error: {first.error}", status=500, code="engine_error")
                return
            assert first is ACCEPTED
            yield {"type": "start", "request_id": rid, "prompt_tokens": len(ids)}
            stopped_by_string = False
            while True:
                item = await q.get()
                if isinstance(item, Failed):
                    done = True
                    yield _error(f"engine error: {item.error}", status=500, code="engine_error")
                    return
                if isinstance(item, Aborted):  # our own abort after a stop string
                    done = True
                    yield self._end(rid, "stop", len(ids), generated, rounds, None)
                    return
                if stopped_by_string and not item.finished:  # in flight before our abort landed
                    continue
                new = list(item.new_token_ids)
                if new:
                    generated += len(new)
                    rounds += 1
                    with self._lock:
                        self.counters["generation_tokens"] += len(new)
                        self._tokens_emitted += len(new)
                    text, hit = stops.feed(detok.push(new))
                    if item.finished and not hit:
                        more, hit = stops.feed(detok.flush())
                        text += more
                        text += "" if hit else stops.flush()
                    if text or new:
                        yield {"type": "delta", "text": text, "token_ids": new}
                    if hit and not item.finished:
                        stopped_by_string = True
                        self.loop.abort(rid)
                        continue
                    if hit:
                        stopped_by_string = True
                if item.finished:
                    done = True
                    reason = "stop" if stopped_by_string else (item.finish_reason or "stop")
                    yield self._end(rid, reason, len(ids), generated, rounds, item.stats)
                    return
        finally:
            if not done:  # the caller went away (client disconnect): free the KV now
                self.loop.abort(rid)
                with self._lock:
                    self.counters["requests_aborted"] += 1
                    self.counters["prompt_tokens"] += len(ids)

    def _end(self, rid: str, reason: str, n_prompt: int, generated: int, rounds: int, stats: Any) -> dict[str, Any]:
        with self._lock:
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += n_prompt
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
        usage = {"prompt_tokens": n_prompt, "completion_tokens": generated, "total_tokens": n_prompt + generated}
        return {"type": "end", "request_id": rid, "finish_reason": reason, "usage": usage, "speculation": spec}

    # -- heartbeat -------------------------------------------------------------
    def make_report(self, dt: float) -> dict[str, Any]:
        window = [s for _, s in self.loop.drain_step_stats()]
        tree = summarize_steps(window)
        if window:
            self.last_tree = tree
        else:  # idle: keep showing the last trees, marked as no steps in this window
            tree = dataclasses.replace(self.last_tree, steps=0)
        records: list[tuple[float, bool]] = []
        rounds: list[tuple[int, int]] = []
        with self._lock:
            for s in window:
                self.counters["steps"] += 1
                self.counters["rounds"] += s.batch_size
                self.counters["draft_tokens"] += sum(s.tree_sizes)
                self.counters["accepted_tokens"] += sum(s.accepted)
                records.extend((_logit(float(q)), bool(y)) for q, y in s.calibration_records)
                # keyed by the step's widest tree: every row paid for that width (padding)
                width = max(s.tree_sizes, default=0)
                rounds.extend((width, a) for a in s.accepted)
            emitted, self._tokens_emitted = self._tokens_emitted, 0
            counters = dict(self.counters)
        load = self.loop.load
        return {
            "replica_id": self.replica_id,
            "active": load.running,
            "queued": load.waiting,
            "kv_slots_in_use": load.kv_slots_in_use,
            "rss_bytes": rss_bytes(),
            "tokens_per_s": emitted / dt if dt > 0 else 0.0,
            "tree": tree.__dict__,
            "budget": budget_to_wire(self.budget),
            "budget_source": self.budget_source,
            "counters": counters,
            "calibration_records": records[-1024:],
            "calibration": self.calibration,
            "round_records": rounds[-2048:],
            "base_calibration": self.base_calibration,
        }

    def apply_budget(self, budget: Budget, source: str) -> None:
        self.budget_source = source
        if budget != self.budget:
            self.budget = budget
            self.loop.set_budget(budget)

    def heartbeat_once(self, handle: Any, dt: float) -> dict[str, Any]:
        """One report; raises if the controller does not answer in time."""
        import ray

        report = self.make_report(dt)
        reply = ray.get(handle.report.remote(report), timeout=self.args.controller.rpc_timeout_s)
        self.apply_budget(budget_from_wire(reply["budget"]), "controller")
        if reply.get("registered"):
            self.registrations += 1
        cal = reply.get("calibration")
        if cal is not None and tuple(cal) != self.calibration:
            self.calibration = (float(cal[0]), float(cal[1]))
            self.loop.set_calibration(*self.calibration)
        return reply

    def _heartbeat_loop(self) -> None:
        period = self.args.controller.heartbeat_s
        handle, last, retry_at = None, time.monotonic(), 0.0
        while not self._stop.wait(period):
            now = time.monotonic()
            if handle is None and now < retry_at:  # controller down: back off a little
                self._use_local_policy()
                continue
            try:
                if handle is None:
                    handle = self._connect()
                self.heartbeat_once(handle, now - last)
                self.controller_ok = True
                self.heartbeats_ok += 1
            except Exception as err:  # noqa: BLE001 - controller unreachable: serve on
                self.heartbeats_failed += 1
                self.last_heartbeat_error = repr(err)[:500]
                if self.controller_ok:
                    log.warning("replica %s: controller unreachable (%r); using the local policy", self.replica_id, err)
                self.controller_ok = False
                handle, retry_at = None, time.monotonic() + 0.5
                self._use_local_policy()
            last = now

    def _use_local_policy(self) -> None:
        load = self.loop.load
        self.apply_budget(self.policy.budget_for(LoadSnapshot(1, load.running, load.waiting), self.replica_id), "local")

    def status(self) -> dict[str, Any]:
        load = self.loop.load
        return {
            "replica_id": self.replica_id,
            "budget": budget_to_wire(self.budget),
            "budget_source": self.budget_source,
            "controller_ok": self.controller_ok,
            "registrations": self.registrations,
            "heartbeats_ok": self.heartbeats_ok,
            "heartbeats_failed": self.heartbeats_failed,
            "last_heartbeat_error": self.last_heartbeat_error,
            "heartbeat_alive": self._hb.is_alive(),
            "running": load.running,
            "waiting": load.waiting,
            "kv_slots_in_use": load.kv_slots_in_use,
            "rss_bytes": rss_bytes(),
            "engine_alive": load.alive,
            "steps": self.loop.steps,
            "tree": self.last_tree.__dict__,
        }

    def shutdown(self) -> None:
        self._stop.set()
        self.loop.stop()


@serve.deployment(name="Replica", max_ongoing_requests=64, health_check_period_s=5)
class Replica:
    """Serve deployment around ``ReplicaCore``; resources and scaling come from ``AppArgs``."""

    def __init__(self, args: dict[str, Any]) -> None:
        from deployments.controller import get_or_create_controller

        a = AppArgs.model_validate(args)
        if a.replica.torch_threads:
            import torch

            torch.set_num_threads(a.replica.torch_threads)
        ctx = serve.get_replica_context()
        rid = str(getattr(ctx.replica_id, "unique_id", ctx.replica_id))
        self.core = ReplicaCore(a, rid, connect=lambda: get_or_create_controller(args))

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for event in self.core.generate(req):
            yield event

    def status(self) -> dict[str, Any]:
        return self.core.status()

    def check_health(self) -> None:
        if not self.core.loop.alive:
            raise RuntimeError("engine loop thread died")

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()

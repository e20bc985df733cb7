"""One synchronous ``Engine`` driven by one dedicated thread, bridged to asyncio.

The engine is not thread-safe, so only the loop thread touches it. Callers post
commands (add, abort, set_budget, set_allocating, set_calibration) on a thread-safe queue; the thread
drains the queue, runs ``engine.step()`` while there is work, and otherwise blocks on
the queue. Each request has a *sink*, a callable the loop thread invokes with:

* ``ACCEPTED``           once, when ``add_request`` succeeded;
* ``SCHEDULED``          at most once, when the engine took the request from its waiting
                         queue (engines with an ``on_schedule(request_id)`` hook only);
* ``Failed(error)``      once, final: ``add_request`` raised (``ValueError`` = bad input)
                         or the engine crashed;
* a ``RequestOutput``    per step with new tokens; the one with ``finished`` is final;
* ``Aborted(id)``        once, final, right after ``abort`` (later outputs are dropped).

Sinks must be cheap and thread-safe; ``asyncio_sink`` hands items to an
``asyncio.Queue`` on the caller's event loop. No Ray here: tests drive it directly.

Build the engine *on* the loop thread (``call`` then ``attach``): PyTorch's OpenMP
runtime gives every thread that runs a parallel region its own worker team, and with
two teams on a small CPU (one left by model loading on the caller's thread, one for
the loop) GNU OpenMP throttles its spin-waits, so every small parallel op pays a futex
wake-up. Measured on 2 cores: a 4-token verify step took ~88 ms instead of ~54 ms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)


@runtime_checkable
class ServedEngine(Protocol):
    """What a replica needs of an engine: ``treespark.engine.core.Engine`` and the tests'
    fake engine both satisfy it. ``on_step`` is called with each step's ``StepStats``,
    ``on_schedule`` with a request id leaving the waiting queue (None: no hook). The
    engine's cumulative counters and KV usage use vLLM's meanings: prefix-cache queries
    and hits in prompt tokens (a preempted request's recomputation counts again),
    preemptions in requests."""

    on_step: Callable[[Any], None] | None
    on_schedule: Callable[[str], None] | None
    prefix_cache_queries: int   # prompt tokens looked up in the prefix cache so far
    prefix_cache_hits: int      # of those, tokens found cached (not computed)
    preemptions: int            # requests preempted so far

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float | None: ...   # fraction of KV blocks held by requests (None: no KV cache)

    def add_request(self, request_id: str, prompt_ids: list[int], params: Any) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[Any]: ...

    def set_budget(self, budget: Any) -> None: ...

    def set_calibration(self, a: float, b: float) -> None: ...

ACCEPTED = object()
SCHEDULED = object()


@dataclass(frozen=True)
class Failed:
    error: BaseException


class LoopStopped(RuntimeError):
    """The error of ``Failed`` items for requests the loop dropped because it stopped (the
    replica is going away), not because of anything in the request."""


@dataclass(frozen=True)
class Aborted:
    request_id: str


Sink = Callable[[Any], None]


def asyncio_sink(q: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> Sink:
    def sink(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    return sink


# -- commands on the loop's queue ----------------------------------------------------

@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: Any
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _SetBudget:
    budget: Any


@dataclass(frozen=True)
class _SetAllocating:
    on: bool


@dataclass(frozen=True)
class _SetCalibration:
    a: float
    b: float


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: wakes a loop blocked on the queue (``stop``)."""


Command = _Add | _Abort | _SetBudget | _SetAllocating | _SetCalibration | _Call | _Wake


@dataclass(frozen=True)
class LoopLoad:
    running: int
    waiting: int
    alive: bool
    kv_usage: float | None = None   # fraction of the engine's KV blocks held by requests (None: no KV cache)
    prefix_cache_queries: int = 0   # the engine's counters (``ServedEngine``), cumulative
    prefix_cache_hits: int = 0
    preemptions: int = 0


class EngineLoop:
    """Owns ``engine`` in a daemon thread. ``step_stats`` keeps the engine's recent
    ``StepStats`` for heartbeats (``drain_step_stats``)."""

    def __init__(self, engine: ServedEngine | None = None, *, name: str = "treespark-engine",
                 max_step_stats: int = 4096) -> None:
        self.engine: ServedEngine | None = None
        self._user_on_step: Callable[[Any], None] | None = None
        self._user_on_schedule: Callable[[str], None] | None = None
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stats: deque = deque(maxlen=max_step_stats)
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._load = LoopLoad(0, 0, False)
        self.steps = 0
        self.last_error: str | None = None
        self._parked: Any = None    # the engine's per-step allocator while a fixed budget runs
        if engine is not None:
            self._attach(engine)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- callers (any thread) ------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._cmds.put(_Wake())
        self._thread.join(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` on the loop thread, between steps, and return its result (or raise
        what it raised). For torch work that should share the engine's thread, such as
        building the engine itself."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine loop thread is not running")
        if threading.current_thread() is self._thread:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Call(fn, fut))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return fut.result(0.25)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():  # died after we looked: nobody will run it
                    self._fail_queued()
                    return fut.result(0)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the engine loop did not run the call within {timeout} s") from None

    def attach(self, engine: ServedEngine) -> None:
        """Serve ``engine`` (on a loop started without one); requests added before fail."""
        self.call(lambda: self._attach(engine))

    def add(self, request_id: str, prompt_ids: list[int], params: Any, sink: Sink) -> None:
        self._cmds.put(_Add(request_id, prompt_ids, params, sink))

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id))

    def set_budget(self, budget: Any) -> None:
        self._cmds.put(_SetBudget(budget))

    def set_allocating(self, on: bool) -> None:
        """Run the engine's per-step allocation (True), or verify its budget as is (False:
        a fixed override); an engine without an allocation is left as it is."""
        self._cmds.put(_SetAllocating(on))

    def set_calibration(self, a: float, b: float) -> None:
        self._cmds.put(_SetCalibration(a, b))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def load(self) -> LoopLoad:
        """Running and waiting requests as of the last loop iteration, plus requests
        whose ``add`` is still in the command queue (counted as waiting)."""
        last = self._load
        return replace(last, waiting=last.waiting + self._cmds.qsize(), alive=self.alive)

    def drain_step_stats(self) -> list[Any]:
        with self._stats_lock:
            out = list(self._stats)
            self._stats.clear()
        return out

    # -- the loop thread -------------------------------------------------------
    def _attach(self, engine: ServedEngine) -> None:
        if self.engine is not None:
            raise RuntimeError("the engine loop already has an engine")
        if not isinstance(engine, ServedEngine):
            raise TypeError(f"{type(engine).__name__} is not a ServedEngine")
        self._user_on_step = engine.on_step
        engine.on_step = self._on_step
        self._user_on_schedule = engine.on_schedule   # lets replicas time the queue
        engine.on_schedule = self._on_schedule
        self.engine = engine

    def _on_step(self, stats: Any) -> None:
        with self._stats_lock:
            self._stats.append((time.monotonic(), stats))
        if self._user_on_step is not None:
            self._user_on_step(stats)

    def _on_schedule(self, request_id: str) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink(SCHEDULED)
        if self._user_on_schedule is not None:
            self._user_on_schedule(request_id)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # the thread is dying: say why, then fail what waits
            log.exception("engine loop died")
            self.last_error = repr(err)
            raise
        finally:
            for rid in list(self._sinks):
                self._finish(rid, Failed(LoopStopped("engine loop stopped")))
            self._fail_queued()

    def _fail_queued(self) -> None:
        """Answer the commands nobody will run: pending calls raise, adds fail."""
        stopped = LoopStopped("engine loop stopped")
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(stopped)
            elif isinstance(cmd, _Add):
                cmd.sink(Failed(stopped))

    def _serve(self) -> None:
        self._snapshot_load()
        while not self._stop.is_set():
            busy = self._has_work()
            try:
                cmd = self._cmds.get(block=not busy, timeout=None if busy else 0.5)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stop.is_set():
                break
            if self._has_work():
                self._step()
            self._snapshot_load()

    def _has_work(self) -> bool:
        if self.engine is None:
            return False
        try:
            return bool(self.engine.has_unfinished())
        except Exception:  # noqa: BLE001
            return False

    def _snapshot_load(self) -> None:
        e = self.engine
        if e is None:
            self._load = LoopLoad(0, 0, True)
            return
        self._load = LoopLoad(int(e.num_running), int(e.num_waiting), True, e.kv_usage, int(e.prefix_cache_queries),
                              int(e.prefix_cache_hits), int(e.preemptions))

    def _finish(self, request_id: str, item: Any) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink(item)

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, _Call):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn())
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    cmd.future.set_exception(err)
            return
        if self.engine is None:
            if isinstance(cmd, _Add):
                cmd.sink(Failed(RuntimeError("the engine is not ready yet")))
            return
        match cmd:
            case _Add(rid, prompt_ids, params, sink):
                if rid in self._sinks:
                    sink(Failed(ValueError(f"duplicate request id {rid!r}")))
                    return
                try:
                    self.engine.add_request(rid, prompt_ids, params)
                except Exception as err:  # noqa: BLE001 - ValueError is bad input, anything else is ours
                    sink(Failed(err))
                    return
                self._sinks[rid] = sink
                sink(ACCEPTED)
            case _Abort(rid):
                if rid in self._sinks:
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001
                        log.exception("engine.abort(%s) failed", rid)
                    self._finish(rid, Aborted(rid))
            case _SetBudget(budget):
                self._push(cmd, lambda: self.engine.set_budget(budget))
            case _SetAllocating(on):
                self._push(cmd, lambda: self._allocating(on))
            case _SetCalibration(a, b):
                self._push(cmd, lambda: self.engine.set_calibration(a, b))
            case _Wake():
                pass

    def _allocating(self, on: bool) -> None:
        """Park the engine's allocator (``on`` False) or give it back (True)."""
        if getattr(self.engine, "set_allocator", None) is None:
            return
        if not on and self.engine.allocator is not None:
            self._parked = self.engine.allocator
            self.engine.set_allocator(None)
        elif on and self._parked is not None:
            self.engine.set_allocator(self._parked)
            self._parked = None

    def _push(self, cmd: Command, apply: Callable[[], None]) -> None:
        """A setting pushed to the engine; a bad one keeps the engine's previous setting and
        the loop serves on."""
        try:
            apply()
        except Exception as err:  # noqa: BLE001
            log.exception("the engine refused %r", cmd)
            self.last_error = repr(err)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # noqa: BLE001 - fail the batch, keep the loop alive
            log.exception("engine.step() failed")
            self.last_error = repr(err)
            for rid in list(self._sinks):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
                self._finish(rid, Failed(RuntimeError(f"engine step failed: {err!r}")))
            return
        self.steps += 1
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted earlier: already finished for the caller
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)

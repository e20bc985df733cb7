"""The HTTP API in-process, without Ray: the real ``Api`` routes over a ``ReplicaCore``.

``LocalApi`` builds the ``Api`` deployment's class around a stand-in for the Serve
handle (each ``generate`` call is pumped by its own task, and ``cancel()`` cancels it,
as Serve does) and drives the FastAPI app through ASGI directly, so security and fuzz
tests run in milliseconds per request. ``disconnect_after`` ends the client side after
that many body chunks, as a client closing a stream does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import Any

from deployments.config import AppArgs
from deployments.controller.state import ControllerState
from deployments.http.api import Api, app
from deployments.replica.core import ReplicaCore

_END = object()


class _Gen:
    """What ``handle.options(stream=True).generate.remote(req)`` returns."""

    def __init__(self, agen: Any, fail: BaseException | None = None) -> None:
        self._q: asyncio.Queue = asyncio.Queue()
        self._fail = fail
        self._task = asyncio.get_running_loop().create_task(self._pump(agen))

    async def _pump(self, agen: Any) -> None:
        try:
            async for ev in agen:
                self._q.put_nowait(ev)
            self._q.put_nowait(_END)
        finally:
            await agen.aclose()

    def __aiter__(self) -> _Gen:
        return self

    async def __anext__(self) -> Any:
        if self._fail is not None:
            raise self._fail
        item = await self._q.get()
        if item is _END:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self._task.cancel()


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class LocalReplicaHandle:
    """Stand-in for the ``Replica`` deployment handle. ``fail_next``: exceptions the next
    ``generate`` calls raise (e.g. ``RayActorError`` for a replica that died)."""

    def __init__(self, core: ReplicaCore) -> None:
        self.core = core
        self.fail_next: list[BaseException] = []
        self.calls = 0

        def generate(req: dict[str, Any]) -> _Gen:
            self.calls += 1
            fail = self.fail_next.pop(0) if self.fail_next else None
            return _Gen(self.core.generate(req), fail)

        async def status() -> dict[str, Any]:
            return self.core.status()

        self.generate = _Method(generate)
        self.status = _Method(status)

    def options(self, **_: Any) -> LocalReplicaHandle:
        return self


class LocalController:
    """Stand-in for the controller actor handle: a ``ControllerState`` in-process."""

    def __init__(self, args: AppArgs) -> None:
        self.state = ControllerState(args.policy.build(args.max_batch_size), cluster_pricing=args.controller.pricing)

        async def status() -> dict[str, Any]:
            return self.state.status()

        async def metrics_view() -> dict[str, Any]:
            return self.state.metrics_view()

        async def set_override(budget: Any, fixed: bool = False) -> None:
            from treespark.spec.budget import Budget

            self.state.set_override(None if budget is None else Budget.from_wire(budget), fixed)

        async def set_pricing(cluster: bool) -> None:
            self.state.set_pricing(cluster)

        async def report_ingress(ingress_id: str, samples: list) -> None:
            self.state.report_ingress(ingress_id, samples)

        self.status = _Method(status)
        self.metrics_view = _Method(metrics_view)
        self.report_ingress = _Method(report_ingress)
        self.set_override = _Method(set_override)
        self.set_pricing = _Method(set_pricing)


def _api_class() -> type:
    return next(c for c in Api.func_or_class.__mro__ if "_generate" in c.__dict__)


def _self_dependency() -> Any:
    from ray.serve._private.http_util import _walk_fastapi_routes

    for route, _parent, _prefix in _walk_fastapi_routes(app):
        if getattr(getattr(route, "endpoint", None), "_serve_cls", None) is not None:
            return inspect.signature(route.endpoint).parameters["self"].default.dependency
    raise RuntimeError("no class-based routes on the API app")


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def sse(self) -> list[Any]:
        out = []
        for line in self.body.decode().splitlines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out


class LocalApi:
    """The API over one in-process replica core (``engine_factory`` from ``args``)."""

    def __init__(self, args: AppArgs) -> None:
        self.args = args
        self.loop = asyncio.new_event_loop()
        self.core = ReplicaCore(args, "local-0", connect=None)
        self.handle = LocalReplicaHandle(self.core)
        cls = _api_class()
        self.api = object.__new__(cls)
        cls.__init__(self.api, self.handle, args.wire())
        self.api._controller = LocalController(args)
        self._dep = _self_dependency()

    def close(self) -> None:
        self.core.shutdown()
        self.loop.close()

    def beat(self, dt: float = 0.25) -> dict[str, Any]:
        """One heartbeat of the replica to the in-process controller (no thread runs them here)."""
        from deployments.reports import ReplicaReport

        return self.api._controller.state.report(ReplicaReport.from_wire(self.core.heartbeat.make_report(dt)))

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                disconnect_after: int | None = None, timeout: float = 30.0) -> Response:
        if isinstance(body, (bytes, bytearray)):
            raw = bytes(body)
        elif body is None:
            raw = b""
        else:
            raw = json.dumps(body).encode()
        hdrs = {"content-type": "application/json", "content-length": str(len(raw)), **(headers or {})}
        app.dependency_overrides[self._dep] = lambda: self.api
        return self.loop.run_until_complete(asyncio.wait_for(self._call(method, path, raw, hdrs, disconnect_after), timeout))

    def post(self, path: str, body: Any = None, **kw: Any) -> Response:
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    async def _call(self, method: str, path: str, raw: bytes, headers: dict[str, str],
                    disconnect_after: int | None) -> Response:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
        }
        sent_body = False
        gone = asyncio.Event()
        status, out_headers, chunks = 0, {}, []

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            nonlocal status, out_headers
            if gone.is_set():
                raise OSError("client disconnected")
            if msg["type"] == "http.response.start":
                status = msg["status"]
                out_headers = {k.decode().lower(): v.decode() for k, v in msg.get("headers", [])}
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    chunks.append(msg["body"])
                if not msg.get("more_body", False):
                    gone.set()
                elif disconnect_after is not None and len(chunks) >= disconnect_after:
                    gone.set()

        try:
            await app(scope, receive, send)
        except OSError:
            pass
        except Exception:  # noqa: BLE001 - Starlette re-raises after its 500 handler answered
            if not status:
                raise
        gone.set()
        return Response(status, out_headers, b"".join(chunks))

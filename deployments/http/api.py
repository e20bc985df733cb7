"""The OpenAI-compatible HTTP ingress: the FastAPI routes and the ``Api`` deployment.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE with
``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /v1/speculation`` (each
replica's budget and recent tree statistics, from the controller),
``POST /v1/speculation/override`` (pin one budget for all replicas, or ``null`` to
release), ``POST /v1/speculation/pricing`` (price the replicas on the cluster's load or
each on its own), ``GET /metrics`` (Prometheus text).

The ingress parses and validates (``deployments.http.validation`` over the schemas of
``deployments.http.schemas``); tokenization, context checks and stop strings happen in the
engine replica, which owns the tokenizer. Every bad input is a 4xx with an OpenAI
error body ``{"error": {"message", "type", "param", "code"}}`` (``deployments.http.errors``);
engine events become responses in ``deployments.http.responses``.

Reliability and security (``AppArgs.limits``, ``AppArgs.api_key_env``):

* limits on the body (413), prompt, messages, max_tokens and stop sequences (400);
* with ``api_key_env`` set, every route but ``/health`` needs ``Authorization: Bearer``
  (401 otherwise);
* overload: Serve's ``max_queued_requests`` (per caller) rejects at once, answered as
  503/429 with ``Retry-After``; a request no replica takes within ``queue_timeout_s`` gets
  503 too; nothing waits forever;
* a request whose engine replica dies or drains is re-issued to another replica with the
  same seed (every sampled request gets one here), before or after its response started:
  a stream under way continues where it was (``deployments.http.resume``), at most
  ``limits.replica_retries`` times; the resends, resumes and failed streams are counted in
  ``/metrics``;
* 5xx bodies never carry exception text, tracebacks or paths: those go to the log under
  an ``error id`` that the body names.
"""


import asyncio
import hmac
import logging
import os
import random
import time
import uuid
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import AppArgs
from deployments.controller.controller import get_or_create_controller
from deployments.http.errors import (
    error_response,
    internal_error,
    retry_after,
    validation_error_response,
)
from deployments.http.openapi import answers, request_body
from deployments.http.openapi import install as install_openapi
from deployments.http.responses import (
    cancel_call,
    completion_body,
    engine_error_response,
    sse_stream,
)
from deployments.http.resume import ReplicaFailed, ResumableCall
from deployments.http.schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatRequest,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelList,
    OverrideRequest,
    OverrideResponse,
    PricingRequest,
    PricingResponse,
    SamplingRequest,
    SpeculationStatus,
)
from deployments.http.validation import (
    check_override,
    choice_requests,
    engine_request,
    json_body,
    parse,
)
from deployments.metrics import CONTENT_TYPE, IngressMetrics, render

log = logging.getLogger(__name__)
_Body = TypeVar("_Body", bound=BaseModel)  # an admin route's request schema

app = FastAPI(
    title="TreeSpark Serve",
    version="0.1.0",
    description="OpenAI-compatible completions with speculative decoding on calibrated, load-adaptive draft trees. "
                "With `api_key_env` set, every route but `/health` (and this document) needs "
                "`Authorization: Bearer <key>`.",
    docs_url="/docs",
    redoc_url=None,
)
install_openapi(app)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), code=None)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_response(exc)


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    eid = uuid.uuid4().hex[:12]
    if isinstance(exc, TaskCancelledError):  # the client went away mid-stream; nobody reads this
        log.info("request cancelled (client disconnected) [error id %s]", eid)
    else:
        log.exception("unhandled error [error id %s]", eid)
    return error_response(500, f"internal server error (error id {eid})", code="internal_error")


async def _all(coros: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await every coroutine concurrently (one per choice); if one raises or the caller is
    cancelled, the others are cancelled too (their handle calls with them)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


def _first_error(results: list[Any]) -> JSONResponse | None:
    return next((r for r in results if isinstance(r, JSONResponse)), None)


# -- the ingress deployment ---------------------------------------------------------


@serve.deployment(name="Api", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Api:
    def __init__(self, replica: DeploymentHandle, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        self._wire = args
        self.replica = replica
        self.model = self.args.model_name
        self.created = int(time.time())
        self._controller = None
        self._seeds = random.SystemRandom()   # seeds of sampled requests that bring none
        self.ingress_id = uuid.uuid4().hex[:12]   # names this API replica's counters to the controller
        self.metrics = IngressMetrics()
        self.metrics.on_change = self._push_metrics_soon
        self._metrics_pushed = -1   # the ``changes`` the controller has (-1: nothing yet)
        self._push_task: asyncio.Task | None = None
        self._api_key: bytes | None = None
        if self.args.api_key_env is not None:
            key = os.environ.get(self.args.api_key_env, "")
            if not key:  # fail closed: a configured but missing key must not mean "no auth"
                raise RuntimeError(f"api_key_env names {self.args.api_key_env!r}, which is unset or empty")
            self._api_key = key.encode()

    # -- helpers ----------------------------------------------------------------
    async def _admin_body(self, request: Request, schema: type[_Body]) -> _Body | JSONResponse:
        """An admin route's authorized JSON body, validated by ``schema``; else the 401,
        400 or 413 to answer."""
        if (denied := self._auth(request)) is not None:
            return denied
        body = await json_body(request, self.args.limits.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        try:
            return schema.model_validate(body)
        except ValidationError as err:
            return validation_error_response(err)

    def _auth(self, request: Request) -> JSONResponse | None:
        """None if the request may pass; a 401 otherwise."""
        if self._api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key):
            return None
        return error_response(401, "Missing or incorrect API key: send `Authorization: Bearer <key>`.",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _engine_request(self, req: SamplingRequest) -> dict[str, Any] | JSONResponse:
        """The engine request; a sampled one without a seed gets one (not echoed), so that a
        replica failure can be resumed exactly on another replica."""
        ereq = engine_request(req)
        if not isinstance(ereq, JSONResponse) and ereq["temperature"] > 0 and ereq["seed"] is None:
            ereq["seed"] = self._seeds.getrandbits(63)
        return ereq

    async def _controller_call(self, method: str, *args: Any) -> Any:
        timeout = self.args.controller.rpc_timeout_s
        if self._controller is None:
            self._controller = get_or_create_controller(self._wire)
        try:
            return await asyncio.wait_for(getattr(self._controller, method).remote(*args), timeout)
        except Exception:
            self._controller = None
            raise

    def _push_metrics_soon(self) -> None:
        """Send this API replica's counters to the controller in the background, once per
        burst of changes (a failed push is retried with the next change or scrape)."""
        if self._push_task is None or self._push_task.done():
            self._push_task = asyncio.ensure_future(self._push_metrics())

    async def _push_metrics(self) -> None:
        while self._metrics_pushed != self.metrics.changes:
            changes = self.metrics.changes
            try:
                await self._controller_call("report_ingress", self.ingress_id, self.metrics.snapshot())
            except Exception as err:  # noqa: BLE001 - the counters wait for the next push
                log.info("could not report the ingress counters to the controller (%r)", err)
                return
            self._metrics_pushed = changes

    def _controller_unavailable(self, err: BaseException) -> JSONResponse:
        return error_response(503, f"the controller is unavailable ({type(err).__name__})", code="controller_unavailable",
                              headers=retry_after(self.args.replica.retry_after_s))

    # -- generation -----------------------------------------------------------
    async def _generate(self, request: Request, schema: type[SamplingRequest]) -> Any:
        if (denied := self._auth(request)) is not None:
            return denied
        req = await parse(request, schema, self.args)
        if isinstance(req, JSONResponse):
            return req
        ereq = self._engine_request(req)
        if isinstance(ereq, JSONResponse):
            return ereq
        chat = isinstance(req, ChatRequest)
        prefix = "chatcmpl-" if chat else "cmpl-"
        ereqs = choice_requests(ereq, req.n)  # n independent engine requests
        if req.stream:
            opened = await _all(self._call(e) for e in ereqs)
            if (refused := _first_error(opened)) is not None:
                for o in opened:
                    if not isinstance(o, JSONResponse):
                        o.cancel()
                return refused
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            rid = prefix + opened[0].request_id
            return StreamingResponse(sse_stream(opened, rid, chat, include_usage, self.model,
                                                on_error=self.metrics.stream_failed),
                                     media_type="text/event-stream")
        done = await _all(self._complete(e) for e in ereqs)
        if (refused := _first_error(done)) is not None:
            return refused
        return completion_body(prefix + done[0][0]["request_id"], chat, self.model,
                               [(text, end, lps) for _, text, end, lps in done])

    async def _call(self, ereq: dict[str, Any], stream: bool = True) -> ResumableCall | JSONResponse:
        """One engine request, started on some replica (re-issued while replicas fail, up to
        ``limits.replica_retries`` times in all), or the refusal."""
        call = ResumableCall(ereq, self._open, self.args.limits.replica_retries, self.metrics, stream=stream,
                             retry_after_s=self.args.replica.retry_after_s)
        refused = await call.open()
        return call if refused is None else refused

    async def _open(self, ereq: dict[str, Any]) -> tuple[Any, dict[str, Any]] | JSONResponse:
        """Start one engine request on one replica: (the handle call, its first event), or the
        refusal; raises ``ReplicaFailed`` if the replica died first (nothing was sent)."""
        gen = None
        try:  # (Serve may raise BackPressureError from .remote() itself)
            gen = self.replica.options(stream=True).generate.remote(ereq)
            first = await asyncio.wait_for(gen.__anext__(), self.args.limits.queue_timeout_s)
        except BackPressureError as err:
            cancel_call(gen)
            headers = retry_after(err.retry_after_s) if err.retry_after_s is not None else None
            return error_response(err.status_code, "the server is overloaded; retry later", code="overloaded",
                                  headers=headers)
        except (asyncio.TimeoutError, DeploymentUnavailableError) as err:
            cancel_call(gen)
            what = "no engine replica took the request in time" if isinstance(err, asyncio.TimeoutError) else \
                "no engine replica is available"
            return error_response(503, f"{what}; retry later", code="overloaded",
                                  headers=retry_after(self.args.replica.retry_after_s))
        except asyncio.CancelledError:
            cancel_call(gen)
            raise
        except RayActorError as err:  # ActorDiedError, ActorUnavailableError: ResumableCall re-issues
            cancel_call(gen)
            log.warning("request %s: engine replica failed (%r)", ereq["request_id"], err)
            raise ReplicaFailed() from err
        if first["type"] == "error" and first.get("code") != "replica_stopping":
            return engine_error_response(first)
        return gen, first

    async def _complete(self, ereq: dict[str, Any]) -> tuple[dict[str, Any], str, dict[str, Any], Any] | JSONResponse:
        """One engine request to its end: (first event, whole text, end event, log-prob entries
        or None), or the refusal (resumed on another replica, as a stream is, if its replica
        fails)."""
        call = await self._call(ereq, stream=False)
        if isinstance(call, JSONResponse):
            return call
        texts: list[str] = []
        lps: list[dict[str, Any]] | None = None if ereq.get("logprobs") is None else []
        end: dict[str, Any] | None = None
        try:
            async for ev in call:
                if ev["type"] == "delta":
                    texts.append(ev["text"])
                    if lps is not None:
                        lps += ev.get("logprobs") or ()
                elif ev["type"] == "end":
                    end = ev
                elif ev["type"] == "error":
                    if ev["code"] == "replica_failed":
                        return error_response(503, "the engine replica serving this request failed; retry",
                                              code="replica_failed", headers=retry_after(self.args.replica.retry_after_s))
                    return engine_error_response(ev)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if end is None:
            return internal_error("generation ended without a result", "the replica's event stream ended early")
        return call.start, "".join(texts), end, lps

    @app.post("/v1/completions", summary="Complete a prompt", openapi_extra=request_body(CompletionRequest),
              responses=answers(CompletionResponse, 400, 401, 404, 413, 429, 503, stream=CompletionChunk))
    async def completions(self, request: Request) -> Any:
        return await self._generate(request, CompletionRequest)

    @app.post("/v1/chat/completions", summary="Answer a chat", openapi_extra=request_body(ChatRequest),
              responses=answers(ChatCompletionResponse, 400, 401, 404, 413, 429, 503, stream=ChatCompletionChunk))
    async def chat_completions(self, request: Request) -> Any:
        return await self._generate(request, ChatRequest)

    # -- the rest -------------------------------------------------------------------
    @app.get("/v1/models", summary="The served model", responses=answers(ModelList, 401))
    async def models(self, request: Request) -> Any:
        if (denied := self._auth(request)) is not None:
            return denied
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created, "owned_by": "treespark",
                                             "max_model_len": self.args.max_context}]}

    @app.get("/health", summary="Readiness", responses=answers(Health, 503))
    async def health(self) -> Any:
        """200 once an engine replica answers (readiness), 503 before."""
        try:
            status = await asyncio.wait_for(self.replica.status.remote(), timeout=5.0)
        except Exception as err:  # noqa: BLE001
            return error_response(503, f"no engine replica is ready ({type(err).__name__})", code="not_ready",
                                  headers=retry_after(self.args.replica.retry_after_s))
        if status.get("startup_error"):  # the replica could not load its model: say why
            return error_response(503, f"the engine replica cannot serve: {status['startup_error']}",
                                  code="replica_not_ready")
        if not status.get("engine_alive", False):
            return error_response(503, "the engine loop is not running", code="not_ready")
        return {"status": "ok"}

    async def _authorized_status(self, request: Request, method: str = "status") -> Any:
        """The controller's status dict (or ``method``'s), or the error response to send instead."""
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            return await self._controller_call(method)
        except Exception as err:  # noqa: BLE001
            return self._controller_unavailable(err)

    @app.get("/v1/speculation", summary="Budgets, trees and load per replica",
             responses=answers(SpeculationStatus, 401, 503))
    async def speculation(self, request: Request) -> Any:
        status = await self._authorized_status(request)
        if not isinstance(status, dict):
            return status
        return {"model": self.model, **status}

    @app.post("/v1/speculation/override", summary="Pin one budget for all replicas (null: release)",
              openapi_extra=request_body(OverrideRequest), responses=answers(OverrideResponse, 400, 401, 413, 503))
    async def override(self, request: Request) -> Any:
        req = await self._admin_body(request, OverrideRequest)
        if isinstance(req, JSONResponse):
            return req
        if (refused := check_override(req, self.args)) is not None:
            return refused
        budget = None if req.budget is None else req.budget.model_dump()
        try:
            await self._controller_call("set_override", budget, req.fixed)
        except Exception as err:  # noqa: BLE001
            return self._controller_unavailable(err)
        return {"override": budget, "fixed": budget is not None and req.fixed}

    @app.post("/v1/speculation/pricing", summary="Price on the cluster's load (true) or each replica's own (false)",
              openapi_extra=request_body(PricingRequest), responses=answers(PricingResponse, 400, 401, 409, 413, 503))
    async def pricing(self, request: Request) -> Any:
        req = await self._admin_body(request, PricingRequest)
        if isinstance(req, JSONResponse):
            return req
        if not self.args.controller.pricing:
            return error_response(409, "controller.pricing is false: every replica prices its own queue",
                                  "cluster", "pricing_disabled")
        try:
            await self._controller_call("set_pricing", req.cluster)
        except Exception as err:  # noqa: BLE001
            return self._controller_unavailable(err)
        return {"cluster": req.cluster}

    @app.get("/metrics", summary="Prometheus metrics of the whole cluster", response_class=PlainTextResponse,
             responses=answers(None, 401, 503, text="Prometheus text format 0.0.4"))
    async def metrics(self, request: Request) -> Any:
        if (denied := self._auth(request)) is not None:
            return denied
        await self._push_metrics()   # this API replica's counters, if the controller lacks its latest
        view = await self._authorized_status(request, "metrics_view")
        if not isinstance(view, dict):
            return view
        return Response(render(view, self.model), media_type=CONTENT_TYPE)

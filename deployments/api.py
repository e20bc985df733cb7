"""The OpenAI-compatible HTTP ingress: schemas, routes, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE with
``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /v1/speculation`` (each
replica's budget and recent tree statistics, from the controller),
``POST /v1/speculation/override`` (pin one budget for all replicas, or ``null`` to
release), ``GET /metrics`` (Prometheus text).

The ingress parses and validates; tokenization, context checks and stop strings happen
in the engine replica, which owns the tokenizer. Every bad input is a 4xx with an
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.

Reliability and security (``AppArgs.limits``, ``AppArgs.api_key_env``):

* limits on the body (413), prompt, messages, max_tokens and stop sequences (400);
* with ``api_key_env`` set, every route but ``/health`` needs ``Authorization: Bearer``
  (401 otherwise);
* overload: Serve's ``max_queued_requests`` (per caller) rejects at once, answered as
  503/429 with ``Retry-After``; a request no replica takes within ``queue_timeout_s`` gets
  503 too; nothing waits forever;
* a request whose engine replica dies before its response started is resent once to
  another replica; a stream already under way ends with an SSE error event;
* 5xx bodies never carry exception text, tracebacks or paths: those go to the log under
  an ``error id`` that the body names.
"""


import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import AppArgs, BudgetArgs
from deployments.controller import get_or_create_controller
from deployments.metrics import render

log = logging.getLogger("ray.serve")


# -- schemas ------------------------------------------------------------------------


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Req):
    include_usage: bool = False


class _Sampling(_Req):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)


class TextPart(_Req):
    type: Literal["text"]
    text: str


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class OverrideRequest(_Req):
    budget: BudgetArgs | None


# -- errors -------------------------------------------------------------------------


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if type_ is None:
        type_ = {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable",
                 500: "internal_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def internal_error(what: str, detail: Any, status: int = 500, code: str = "internal_error") -> JSONResponse:
    """A 5xx whose body names only an error id; ``detail`` (an exception, a message that may
    hold paths) goes to the log."""
    eid = uuid.uuid4().hex[:12]
    log.error("%s [error id %s]: %s", what, eid, detail if isinstance(detail, str) else repr(detail))
    return error_response(status, f"{what} (error id {eid})", code=code)


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, int(-(-seconds // 1))))}


def validation_error_response(err: ValidationError | RequestValidationError) -> JSONResponse:
    errors = err.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return error_response(400, f"{where}: {first.get('msg')}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                          param, "invalid_value")


app = FastAPI(title="TreeSpark Serve", docs_url=None, redoc_url=None)


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


class _ReplicaFailed(Exception):
    """The engine replica died (or became unreachable) before the response started."""


def _cancel(gen: Any) -> None:
    """Cancel a handle call, best effort: Serve's ``cancel()`` re-raises the call's own error
    (BackPressureError, a dead actor) when it already failed."""
    if gen is not None:
        with contextlib.suppress(Exception):
            gen.cancel()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


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
        self._api_key: bytes | None = None
        if self.args.api_key_env is not None:
            key = os.environ.get(self.args.api_key_env, "")
            if not key:  # fail closed: a configured but missing key must not mean "no auth"
                raise RuntimeError(f"api_key_env names {self.args.api_key_env!r}, which is unset or empty")
            self._api_key = key.encode()

    # -- helpers ----------------------------------------------------------------
    def _auth(self, request: Request) -> JSONResponse | None:
        """None if the request may pass; a 401 otherwise."""
        if self._api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key):
            return None
        return error_response(401, "Missing or incorrect API key: send `Authorization: Bearer <key>`.",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, request: Request) -> bytes | JSONResponse:
        """The body, or a 413 as soon as it is longer than ``limits.max_body_bytes``."""
        limit = self.args.limits.max_body_bytes
        too_big = error_response(413, f"request body exceeds {limit} bytes", code="request_too_large")
        try:
            if int(request.headers.get("content-length", "0")) > limit:
                return too_big
        except ValueError:
            return error_response(400, "invalid Content-Length", code="invalid_request")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                return too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def _json_body(self, request: Request) -> Any:
        raw = await self._read_body(request)
        if isinstance(raw, JSONResponse):
            return raw
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error_response(400, f"request body is not valid JSON: {err}", code="invalid_json")
        except RecursionError:
            return error_response(400, "request body is nested too deeply", code="invalid_json")

    def _check_limits(self, req: _Sampling) -> JSONResponse | None:
        lim, ctx = self.args.limits, self.args.max_context
        if isinstance(req, ChatRequest):
            if len(req.messages) > lim.max_messages:
                return error_response(400, f"at most {lim.max_messages} messages", "messages", "invalid_value")
            if sum(len(m.text()) for m in req.messages) > lim.max_prompt_chars:
                return error_response(400, f"the messages exceed {lim.max_prompt_chars} characters", "messages",
                                      "context_length_exceeded")
        elif isinstance(req.prompt, str) or all(isinstance(t, str) for t in req.prompt):
            n = len(req.prompt) if isinstance(req.prompt, str) else sum(len(t) for t in req.prompt)
            if n > lim.max_prompt_chars:
                return error_response(400, f"the prompt exceeds {lim.max_prompt_chars} characters", "prompt",
                                      "context_length_exceeded")
        elif len(req.prompt) >= ctx:
            return error_response(400, f"This model's maximum context length is {ctx} tokens; the prompt has "
                                       f"{len(req.prompt)}.", "prompt", "context_length_exceeded")
        limit = min(ctx - 1, lim.max_tokens or ctx)
        mt = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if mt is not None and mt > limit:
            return error_response(400, f"max_tokens must be <= {limit} (the model's context is {ctx} tokens)",
                                  "max_tokens", "invalid_value")
        stops = req.stop_list()
        if len(stops) > lim.max_stop or any(not s or len(s) > lim.max_stop_chars for s in stops):
            return error_response(400, f"stop must be at most {lim.max_stop} non-empty strings of at most "
                                       f"{lim.max_stop_chars} characters", "stop", "invalid_value")
        ids = req.stop_token_ids or ()
        if len(ids) > lim.max_stop_token_ids or any(not 0 <= t < 2**31 for t in ids):
            return error_response(400, f"stop_token_ids must be at most {lim.max_stop_token_ids} non-negative "
                                       "token ids", "stop_token_ids", "invalid_value")
        return None

    async def _parse(self, request: Request, schema: type[_Sampling]) -> _Sampling | JSONResponse:
        body = await self._json_body(request)
        if isinstance(body, JSONResponse):
            return body
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", code="invalid_json")
        try:
            req = schema.model_validate(body)
        except ValidationError as err:
            return validation_error_response(err)
        if req.model != self.model:
            return error_response(404, f"The model `{req.model[:200]}` does not exist. Available: `{self.model}`.",
                                  "model", "model_not_found")
        return self._check_limits(req) or req

    def _engine_request(self, req: _Sampling) -> dict[str, Any] | JSONResponse:
        out: dict[str, Any] = {
            "request_id": uuid.uuid4().hex,
            "max_tokens": req.max_tokens,
            # below 1e-5 sampling is greedy in all but name, and a denormal temperature is 0 in
            # float32 (the engine would divide by it): greedy, as vLLM does
            "temperature": req.temperature if req.temperature >= 1e-5 else 0.0,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": req.stop_list(),
            "stop_token_ids": list(req.stop_token_ids or ()),
            "ignore_eos": req.ignore_eos,
        }
        if isinstance(req, ChatRequest):
            out["max_tokens"] = req.max_completion_tokens or req.max_tokens
            out["messages"] = [{"role": m.role, "content": m.text()} for m in req.messages]
        elif isinstance(req.prompt, str):
            out["prompt"] = req.prompt
        elif all(isinstance(t, int) for t in req.prompt):
            out["prompt_ids"] = list(req.prompt)
        elif len(req.prompt) == 1:
            out["prompt"] = req.prompt[0]
        else:
            return error_response(400, "only one prompt per request is supported", "prompt", "invalid_value")
        return out

    async def _controller_call(self, method: str, *args: Any) -> Any:
        timeout = self.args.controller.rpc_timeout_s
        if self._controller is None:
            self._controller = get_or_create_controller(self._wire)
        try:
            return await asyncio.wait_for(getattr(self._controller, method).remote(*args), timeout)
        except Exception:
            self._controller = None
            raise

    def _controller_unavailable(self, err: BaseException) -> JSONResponse:
        return error_response(503, f"the controller is unavailable ({type(err).__name__})", code="controller_unavailable",
                              headers=retry_after(self.args.replica.retry_after_s))

    # -- generation -----------------------------------------------------------
    async def _generate(self, request: Request, schema: type[_Sampling]) -> Any:
        if (denied := self._auth(request)) is not None:
            return denied
        req = await self._parse(request, schema)
        if isinstance(req, JSONResponse):
            return req
        ereq = self._engine_request(req)
        if isinstance(ereq, JSONResponse):
            return ereq
        retries = self.args.limits.replica_retries
        for attempt in range(retries + 1):
            try:
                return await self._generate_once(req, ereq)
            except _ReplicaFailed as err:
                log.warning("request %s: engine replica failed (%r); attempt %d of %d", ereq["request_id"], err.__cause__,
                            attempt + 1, retries + 1)
                ereq = {**ereq, "request_id": uuid.uuid4().hex}
        return error_response(503, "the engine replica serving this request failed; retry", code="replica_failed",
                              headers=retry_after(self.args.replica.retry_after_s))

    def _engine_error(self, ev: dict[str, Any]) -> JSONResponse:
        if ev["status"] >= 500:  # the message may hold exception text: log it, answer an id
            return internal_error("the engine failed on this request", ev["message"], ev["status"], ev["code"] or "engine_error")
        return error_response(ev["status"], ev["message"], ev["param"], ev["code"])

    async def _generate_once(self, req: _Sampling, ereq: dict[str, Any]) -> Any:
        """One try on one replica; raises ``_ReplicaFailed`` while nothing was sent yet."""
        gen = None
        try:  # (Serve may raise BackPressureError from .remote() itself)
            gen = self.replica.options(stream=True).generate.remote(ereq)
            first = await asyncio.wait_for(gen.__anext__(), self.args.limits.queue_timeout_s)
        except BackPressureError as err:
            _cancel(gen)
            headers = retry_after(err.retry_after_s) if err.retry_after_s is not None else None
            return error_response(err.status_code, "the server is overloaded; retry later", code="overloaded",
                                  headers=headers)
        except (asyncio.TimeoutError, DeploymentUnavailableError) as err:
            _cancel(gen)
            what = "no engine replica took the request in time" if isinstance(err, asyncio.TimeoutError) else \
                "no engine replica is available"
            return error_response(503, f"{what}; retry later", code="overloaded",
                                  headers=retry_after(self.args.replica.retry_after_s))
        except asyncio.CancelledError:
            _cancel(gen)
            raise
        except RayActorError as err:
            _cancel(gen)
            raise _ReplicaFailed() from err
        if first["type"] == "error":
            return self._engine_error(first)
        chat = isinstance(req, ChatRequest)
        rid = ("chatcmpl-" if chat else "cmpl-") + first["request_id"]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(gen, rid, chat, include_usage), media_type="text/event-stream")
        texts: list[str] = []
        end: dict[str, Any] | None = None
        try:
            async for ev in gen:
                if ev["type"] == "delta":
                    texts.append(ev["text"])
                elif ev["type"] == "end":
                    end = ev
                elif ev["type"] == "error":
                    return self._engine_error(ev)
        except asyncio.CancelledError:
            _cancel(gen)
            raise
        except RayActorError as err:  # nothing sent to the client yet: the caller may resend
            _cancel(gen)
            raise _ReplicaFailed() from err
        if end is None:
            return internal_error("generation ended without a result", "the replica's event stream ended early")
        text = "".join(texts)
        base = {"id": rid, "created": int(time.time()), "model": self.model, "usage": end["usage"], "speculation": end["speculation"]}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": end["finish_reason"]}
            return {"object": "chat.completion", **base, "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": end["finish_reason"]}
        return {"object": "text_completion", **base, "choices": [choice]}

    async def _stream(self, gen: Any, rid: str, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [c]}

        def error(what: str, detail: Any, code: str) -> str:
            eid = uuid.uuid4().hex[:12]
            log.error("stream %s: %s [error id %s]: %s", rid, what, eid, detail)
            return _sse({"error": {"message": f"{what} (error id {eid})", "type": "internal_error", "param": None, "code": code}})

        finished = False
        try:
            if chat:
                yield _sse(chunk(None, None, role=True))
            try:
                async for ev in gen:
                    if ev["type"] == "delta" and ev["text"]:
                        yield _sse(chunk(ev["text"], None))
                    elif ev["type"] == "end":
                        finished = True
                        yield _sse(chunk(None if chat else "", ev["finish_reason"]))
                        if include_usage:
                            yield _sse({"id": rid, "object": obj, "created": created, "model": self.model, "choices": [],
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
                _cancel(gen)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._generate(request, ChatRequest)

    # -- the rest -------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        if (denied := self._auth(request)) is not None:
            return denied
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created, "owned_by": "treespark",
                                             "max_model_len": self.args.max_context}]}

    @app.get("/health")
    async def health(self) -> Any:
        """200 once an engine replica answers (readiness), 503 before."""
        try:
            status = await asyncio.wait_for(self.replica.status.remote(), timeout=5.0)
        except Exception as err:  # noqa: BLE001
            return error_response(503, f"no engine replica is ready ({type(err).__name__})", code="not_ready",
                                  headers=retry_after(self.args.replica.retry_after_s))
        if not status.get("engine_alive", False):
            return error_response(503, "the engine loop is not running", code="not_ready")
        return {"status": "ok"}

    async def _authorized_status(self, request: Request) -> Any:
        """The controller's status dict, or the error response to send instead."""
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            return await self._controller_call("status")
        except Exception as err:  # noqa: BLE001
            return self._controller_unavailable(err)

    @app.get("/v1/speculation")
    async def speculation(self, request: Request) -> Any:
        status = await self._authorized_status(request)
        if not isinstance(status, dict):
            return status
        return {"model": self.model, **status}

    @app.post("/v1/speculation/override")
    async def override(self, request: Request) -> Any:
        if (denied := self._auth(request)) is not None:
            return denied
        body = await self._json_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            req = OverrideRequest.model_validate(body)
        except ValidationError as err:
            return validation_error_response(err)
        budget = None if req.budget is None else req.budget.model_dump()
        try:
            await self._controller_call("set_override", budget)
        except Exception as err:  # noqa: BLE001
            return self._controller_unavailable(err)
        return {"override": budget}

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Any:
        status = await self._authorized_status(request)
        if not isinstance(status, dict):
            return status
        return PlainTextResponse(render(status, self.model), media_type="text/plain; version=0.0.4")

"""The OpenAI-compatible HTTP ingress: schemas, routes, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE with
``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /v1/speculation`` (each
replica's budget and recent tree statistics, from the controller),
``POST /v1/speculation/override`` (pin one budget for all replicas, or ``null`` to
release), ``GET /metrics`` (Prometheus text).

The ingress parses and validates; tokenization, context checks and stop strings happen
in the engine replica, which owns the tokenizer. Every bad input is a 4xx with an
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.
"""


import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
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
    seed: int | None = None
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
                   type_: str | None = None) -> JSONResponse:
    if type_ is None:
        type_ = {404: "not_found_error", 503: "service_unavailable", 500: "internal_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


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
    log.exception("unhandled error")
    return error_response(500, f"internal error: {exc!r}", code="internal_error")


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

    # -- helpers ----------------------------------------------------------------
    async def _parse(self, request: Request, schema: type[_Sampling]) -> _Sampling | JSONResponse:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error_response(400, f"request body is not valid JSON: {err}", code="invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", code="invalid_json")
        try:
            req = schema.model_validate(body)
        except ValidationError as err:
            return validation_error_response(err)
        if req.model != self.model:
            return error_response(404, f"The model `{req.model}` does not exist. Available: `{self.model}`.", "model", "model_not_found")
        limit = self.args.max_context - 1
        mt = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if mt is not None and mt > limit:
            return error_response(400, f"max_tokens must be <= {limit} (the model's context is {self.args.max_context} tokens)", "max_tokens", "invalid_value")
        stops = req.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            return error_response(400, "stop must be at most 4 non-empty strings", "stop", "invalid_value")
        if any(not 0 <= t < 2**31 for t in req.stop_token_ids or ()):
            return error_response(400, "stop_token_ids must be non-negative token ids", "stop_token_ids", "invalid_value")
        return req

    def _engine_request(self, req: _Sampling) -> dict[str, Any] | JSONResponse:
        out: dict[str, Any] = {
            "request_id": uuid.uuid4().hex,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
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

    # -- generation -----------------------------------------------------------
    async def _generate(self, request: Request, schema: type[_Sampling]) -> Any:
        req = await self._parse(request, schema)
        if isinstance(req, JSONResponse):
            return req
        ereq = self._engine_request(req)
        if isinstance(ereq, JSONResponse):
            return ereq
        gen = self.replica.options(stream=True).generate.remote(ereq)
        try:
            first = await gen.__anext__()
        except BackPressureError:
            gen.cancel()
            return error_response(503, "the server is overloaded; retry later", code="overloaded")
        except asyncio.CancelledError:
            gen.cancel()
            raise
        if first["type"] == "error":
            return error_response(first["status"], first["message"], first["param"], first["code"])
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
                    return error_response(ev["status"], ev["message"], ev["param"], ev["code"])
        except asyncio.CancelledError:
            gen.cancel()
            raise
        if end is None:
            return error_response(500, "generation ended without a result", code="internal_error")
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

        finished = False
        try:
            if chat:
                yield _sse(chunk(None, None, role=True))
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
                    yield _sse({"error": {"message": ev["message"], "type": "internal_error", "param": None, "code": ev["code"]}})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # client disconnected (or we failed): abort in the engine
                gen.cancel()

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._generate(request, ChatRequest)

    # -- the rest -------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created, "owned_by": "treespark",
                                             "max_model_len": self.args.max_context}]}

    @app.get("/health")
    async def health(self) -> Any:
        """200 once an engine replica answers (readiness), 503 before."""
        try:
            status = await asyncio.wait_for(self.replica.status.remote(), timeout=5.0)
        except Exception as err:  # noqa: BLE001
            return error_response(503, f"no engine replica is ready: {err!r}", code="not_ready")
        if not status.get("engine_alive", False):
            return error_response(503, "the engine loop is not running", code="not_ready")
        return {"status": "ok"}

    @app.get("/v1/speculation")
    async def speculation(self) -> Any:
        try:
            status = await self._controller_call("status")
        except Exception as err:  # noqa: BLE001
            return error_response(503, f"the controller is unavailable: {err!r}", code="controller_unavailable")
        return {"model": self.model, **status}

    @app.post("/v1/speculation/override")
    async def override(self, request: Request) -> Any:
        try:
            req = OverrideRequest.model_validate(json.loads(await request.body()))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error_response(400, f"request body is not valid JSON: {err}", code="invalid_json")
        except ValidationError as err:
            return validation_error_response(err)
        budget = None if req.budget is None else req.budget.model_dump()
        try:
            await self._controller_call("set_override", budget)
        except Exception as err:  # noqa: BLE001
            return error_response(503, f"the controller is unavailable: {err!r}", code="controller_unavailable")
        return {"override": budget}

    @app.get("/metrics")
    async def metrics(self) -> Any:
        try:
            status = await self._controller_call("status")
        except Exception as err:  # noqa: BLE001
            return error_response(503, f"the controller is unavailable: {err!r}", code="controller_unavailable")
        return PlainTextResponse(render(status, self.model), media_type="text/plain; version=0.0.4")

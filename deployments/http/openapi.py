"""The OpenAPI document of the HTTP API (``/openapi.json``, browsable at ``/docs``).

The routes read their bodies themselves (``deployments.http.validation``: a size limit while
reading, then strict pydantic validation, OpenAI error bodies), so FastAPI cannot infer
the request bodies from their signatures. Each route instead declares its body here
(``request_body``: a reference to the request model's schema) and its answers
(``answers``: the response model of each status, errors as ``ErrorBody``); ``install``
puts the request models' schemas (and those of the bodies named by reference) into the
document's components. Nothing here changes
what a route accepts or answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from deployments.http.schemas import (
    ChatCompletionChunk,
    ChatRequest,
    CompletionChunk,
    CompletionRequest,
    ErrorBody,
    OverrideRequest,
    PricingRequest,
)

REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatRequest, OverrideRequest, PricingRequest)
# response bodies named by reference rather than through FastAPI's ``model``: stream events, errors
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (CompletionChunk, ChatCompletionChunk, ErrorBody)

STATUS = {
    400: "Invalid request: a field's type or value, a limit, or a field we cannot honour (code `unsupported_parameter`).",
    401: "Missing or wrong `Authorization: Bearer` key (deployments with `api_key_env`).",
    404: "Another model's name.",
    409: "The controller does not price (`controller.pricing: false`): every replica prices its own queue.",
    413: "The body exceeds `limits.max_body_bytes`.",
    429: "Overloaded (deployments configured with `backpressure_status: 429`); see `Retry-After`.",
    503: "Overloaded, no replica ready, or the controller unreachable; see `Retry-After`.",
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _ref(model)}}}}}


def answers(ok: type[BaseModel] | None, *errors: int, stream: type[BaseModel] | None = None,
            text: str | None = None) -> dict[int | str, dict[str, Any]]:
    """``responses`` of a route: ``ok`` as the 200 JSON body (``stream``: its SSE events with
    ``stream: true``; ``text``: a text/plain body instead), ``errors`` as OpenAI error bodies."""
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        out[200] = {"model": ok, "description": "OK"}
    if stream is not None:
        # each server-sent event (as OpenAPI 3.2's itemSchema for text/event-stream; schemathesis
        # checks every event of a stream against it)
        out[200]["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"],
            "description": f"With `stream: true`: `data: <{stream.__name__}>` events, an error event "
                           "`data: {\"error\": ...}` if the engine fails mid-stream, then `data: [DONE]`.",
            "properties": {"data": {"type": "string", "description": f"JSON: a {stream.__name__} or an "
                                                                     "ErrorBody; or `[DONE]`"},
                           "event": {"type": "string"}, "id": {"type": "string"}}}}}
    if text is not None:
        out[200] = {"description": text, "content": {"text/plain": {"schema": {"type": "string"}}}}
    for s in errors:  # JSON whatever the route's own media type
        out[s] = {"description": STATUS[s], "content": {"application/json": {"schema": {"$ref": _ref(ErrorBody)}}}}
    return out


def _ref(model: type[BaseModel]) -> str:
    return f"#/components/schemas/{model.__name__}"


def install(app: FastAPI) -> None:
    """Serve the document with the request, stream event and error models in its components."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS]
                                         + [(m, "serialization") for m in RESPONSE_MODELS],
                                         ref_template="#/components/schemas/{model}")
            for name, schema in defs["$defs"].items():
                if name in schemas and schemas[name] != schema:
                    raise RuntimeError(f"two different schemas named {name} in the OpenAPI document")
                schemas[name] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]

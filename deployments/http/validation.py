"""From an HTTP request to an engine request: body, schema, limits, translation.

The ingress reads the body under ``limits.max_body_bytes`` (413 beyond), parses it as
JSON into a request schema (400 on any mismatch, 404 for another model's name), checks
the limits that depend on the app config (``check_limits``) and translates the result
into the plain dict an engine replica's ``generate`` takes (``engine_request``), one per
choice when ``n`` > 1 (``choice_requests``). A field set to a value we cannot honour
(``SamplingRequest.unsupported``) is a 400 with code ``unsupported_parameter``. Every
refusal is an OpenAI error response, returned rather than raised.
"""

import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deployments.config import AppArgs
from deployments.http.errors import error_response, validation_error_response
from deployments.http.schemas import ChatRequest, OverrideRequest, SamplingRequest


async def read_body(request: Request, limit: int) -> bytes | JSONResponse:
    """The body, or a 413 as soon as it is longer than ``limit`` bytes."""
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


async def json_body(request: Request, limit: int) -> Any:
    """The body parsed as JSON, or the error response to send instead."""
    raw = await read_body(request, limit)
    if isinstance(raw, JSONResponse):
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return error_response(400, f"request body is not valid JSON: {err}", code="invalid_json")
    except RecursionError:
        return error_response(400, "request body is nested too deeply", code="invalid_json")


def check_limits(req: SamplingRequest, args: AppArgs) -> JSONResponse | None:
    """None if ``req`` is within ``args.limits`` and the model's context; a 400 otherwise."""
    lim, ctx = args.limits, args.max_context
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
    if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:
        return error_response(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    if req.n > lim.max_n:
        return error_response(400, f"n must be <= {lim.max_n}", "n", "invalid_value")
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


def check_override(req: OverrideRequest, args: AppArgs) -> JSONResponse | None:
    """None if the engines can run the override budget; a 400 for a larger ``node_cap``
    than ``args.max_tree_nodes`` (an engine would silently clip it)."""
    if req.budget is not None and req.budget.node_cap > args.max_tree_nodes:
        return error_response(400, f"budget.node_cap: must be <= {args.max_tree_nodes} (the engines' max_tree_nodes)",
                              "budget", "invalid_value")
    return None


async def parse(request: Request, schema: type[SamplingRequest], args: AppArgs) -> SamplingRequest | JSONResponse:
    """The request as ``schema``, validated and within limits, or the error response."""
    body = await json_body(request, args.limits.max_body_bytes)
    if isinstance(body, JSONResponse):
        return body
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object", code="invalid_json")
    try:
        req = schema.model_validate(body)
    except ValidationError as err:
        return validation_error_response(err)
    if req.model != args.model_name:
        return error_response(404, f"The model `{req.model[:200]}` does not exist. Available: `{args.model_name}`.",
                              "model", "model_not_found")
    if (field := req.unsupported()) is not None:
        return error_response(400, f"`{field}` is not supported yet: leave it out (or at its default)", field,
                              "unsupported_parameter")
    return check_limits(req, args) or req


def engine_request(req: SamplingRequest) -> dict[str, Any] | JSONResponse:
    """What the engine replica's ``generate`` takes, under a fresh request id. A sampled
    request that brings a seed is ``reproducible``: its tokens are a function of the
    prompt, the parameters and the seed alone (``treespark.spec.gumbel``), whatever the
    replica's load, and a stream resumed on another replica after a failure goes on with
    the very tokens the first would have sent. One without a seed is verified by the
    rejection walk, which accepts more draft tokens (the API gives it a seed too, not
    echoed, so that its draws are replayed where they can be: ``Api._engine_request``)."""
    # below 1e-5 sampling is greedy in all but name, and a denormal temperature is 0 in
    # float32 (the engine would divide by it): greedy, as vLLM does
    temperature = req.temperature if req.temperature >= 1e-5 else 0.0
    out: dict[str, Any] = {
        "request_id": uuid.uuid4().hex,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "reproducible": req.seed is not None and temperature > 0,
        "stop": req.stop_list(),
        "stop_token_ids": list(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "logprobs": req.logprobs,   # completions: None or how many alternatives
    }
    if isinstance(req, ChatRequest):
        out["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
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


# Choice i > 0 of a seeded request samples with seed + i * SEED_STRIDE (mod 2**64): the
# golden-ratio stride spreads the seeds of neighbouring choices and requests far apart.
SEED_STRIDE = 0x9E3779B97F4A7C15


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice ``i``: the request's own for choice 0 (so ``n`` = 1 and the first
    of ``n`` choices sample alike), a derived one otherwise; None stays None (fresh streams)."""
    if seed is None or i == 0:
        return seed
    return (seed + i * SEED_STRIDE) % 2**64


def choice_requests(ereq: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The ``n`` engine requests of one request: independent choices, each its own id and seed."""
    return [ereq if i == 0 else {**ereq, "request_id": uuid.uuid4().hex, "seed": choice_seed(ereq["seed"], i)}
            for i in range(n)]

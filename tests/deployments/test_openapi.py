"""The OpenAPI document (``/openapi.json``) describes every request and response body, and
the API keeps to it: schemathesis generates positive and negative cases from the document
and sends them to the real routes in-process (``serving.inprocess``, the fake engine);
no 5xx, every status, content type and JSON body as documented.

The CI run here is short (``EXAMPLES`` per operation and mode); ``SCHEMATHESIS_EXAMPLES``
raises it for a longer run (``docs/reliability.md`` gives the command).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from deployments.config import AppArgs, LimitArgs
from deployments.http.api import app
from loadtests.fuzz_openapi import steer

MODEL = "treespark-random"
ARGS = AppArgs(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_batch_size=4,
               max_context=256, limits=LimitArgs(max_tokens=8, max_n=2, max_body_bytes=8192, max_prompt_chars=2000,
                                                 queue_timeout_s=10))
EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "20"))
SEEN: Counter = Counter()  # (operation, status) of every case sent
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


def test_every_body_is_described():
    doc = app.openapi()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post":
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in schemas, (path, ref)
            ok = op["responses"]["200"]["content"]
            assert any(c.get("schema", {}).get("$ref") or c["schema"].get("type") == "string" for c in ok.values()), path
            for status, r in op["responses"].items():
                if status != "200":
                    assert r["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody"), (path, status)
    gen = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert set(gen) == {"200", "400", "401", "404", "413", "429", "503"}
    assert "text/event-stream" in gen["200"]["content"]
    for name in ("CompletionRequest", "ChatRequest", "OverrideRequest", "PricingRequest", "CompletionResponse",
                 "ChatCompletionResponse", "CompletionChunk", "ChatCompletionChunk", "ModelList", "SpeculationStatus",
                 "ErrorBody"):
        assert name in schemas, name
    assert set(schemas["ChatRequest"]["required"]) == {"model", "messages"}


@pytest.fixture(scope="module")
def local_api():
    from serving.inprocess import LocalApi

    a = LocalApi(ARGS)
    app.dependency_overrides[a._dep] = lambda: a.api
    yield a
    app.dependency_overrides.clear()
    a.close()


# eager: the lazy ``schemathesis.pytest.from_fixture`` of 4.32 fails on pytest 9 (``Function._nodeid``)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES,
                                deterministic=True, database="none")
# a negative case may also be too large for limits.max_body_bytes: 413 rejects it too
schema.config.checks.negative_data_rejection.expected_statuses += ["413"]


@schemathesis.hook
def map_body(ctx, body):
    """A valid generation body is steered to the engine: the served model's name (another is
    a 404), no field we refuse as unsupported, n and max_tokens within the limits. Still
    valid, so positive cases stay positive; invalid (negative) bodies go as generated."""
    return steer(ctx.operation.path, body, MODEL, ARGS.limits.max_n, ARGS.limits.max_tokens)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_api_keeps_to_its_document(case, local_api):
    r = case.call_and_validate(checks=CHECKS)
    SEEN[(case.operation.label, r.status_code)] += 1


def test_nothing_left_running(local_api):
    """(After the schemathesis cases: they reached the engine, and left nothing in it.)"""
    import time

    engine = local_api.core.bundle.engine
    deadline = time.time() + 5
    while time.time() < deadline and (engine.num_running or engine.num_waiting):
        time.sleep(0.05)
    assert engine.num_running == 0 and engine.num_waiting == 0
    print(f"schemathesis: {sum(SEEN.values())} cases, {local_api.handle.calls} engine calls; statuses:",
          dict(sorted(Counter(status for _, status in SEEN.elements()).items())))
    for (op, status), count in sorted(SEEN.items()):
        print(f"  {op:32} {status}: {count}")
    assert not any(status >= 500 for _, status in SEEN)
    # the cases reached the engine, not only the validation (19 calls on an idle machine, 9 and 2
    # in full runs: how many valid bodies schemathesis draws, and how many answer in time, varies)
    assert local_api.handle.calls >= 1


def test_docs_page(local_api):
    r = local_api.get("/docs")
    assert r.status == 200 and b"/openapi.json" in r.body

"""Security of the HTTP API, in-process (``serving.inprocess``, no Ray): the API key,
request limits (413 for the body), backpressure answers, error bodies that leak nothing,
loopback binding, and safetensors-only loading on the serving path."""

import ast
import sys
from pathlib import Path

import pytest
import yaml
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from serving.fake_engine import FakeEngine
from serving.inprocess import LocalApi

from deployments.config import AppArgs, LimitArgs

ROOT = Path(__file__).resolve().parents[2]
MODEL = "treespark-random"
KEY_ENV = "TREESPARK_TEST_API_KEY"
KEY = "sk-test-0123456789abcdef"
LEAKS = ("Traceback", "/work", "/home", "/tmp", ".py", 'File "', "secret-path")


def _args(**kw):
    base = dict(model="random", engine_factory="serving.fake_engine:build_fake_engine", max_context=256,
                limits=LimitArgs(max_body_bytes=4096, max_prompt_chars=200, max_tokens=100, max_messages=4,
                                 max_stop=2, max_stop_chars=8, max_stop_token_ids=3))
    return AppArgs(**{**base, **kw})


@pytest.fixture(scope="module")
def api():
    a = LocalApi(_args())
    yield a
    a.close()


def complete(api, **kw):
    return api.post("/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 4, **kw})


def assert_openai_error(r, status, code=None):
    assert r.status == status, (r.status, r.body)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    for leak in LEAKS:
        assert leak not in r.body.decode(), (leak, r.body)
    return err


# -- API key ------------------------------------------------------------------------------

def test_api_key_required_except_health(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    a = LocalApi(_args(api_key_env=KEY_ENV))
    try:
        routes = [("POST", "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2}),
                  ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
                  ("GET", "/v1/models", None), ("GET", "/v1/speculation", None), ("GET", "/metrics", None),
                  ("POST", "/v1/speculation/override", {"budget": None}),
                  ("POST", "/v1/speculation/pricing", {"cluster": True})]
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": f"Bearer {KEY}x"}):
                r = a.request(method, path, body, headers=headers)
                assert_openai_error(r, 401, "invalid_api_key")
                assert r.headers["www-authenticate"] == "Bearer"
            ok = a.request(method, path, body, headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status == 200, (path, ok.status, ok.body)
        assert a.get("/health").status == 200  # readiness stays open
    finally:
        a.close()


def test_api_key_env_unset_refuses_to_start(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match="unset or empty"):
        LocalApi(_args(api_key_env=KEY_ENV))
    with pytest.raises(ValueError):
        AppArgs(api_key_env="not a name; rm -rf")


# -- limits --------------------------------------------------------------------------------

def test_body_size_limit_413(api):
    big = {"model": MODEL, "prompt": "x" * 5000}
    assert_openai_error(api.post("/v1/completions", big), 413, "request_too_large")
    # a body longer than its Content-Length claims is still cut off while read
    r = api.post("/v1/completions", big, headers={"content-length": "10"})
    assert_openai_error(r, 413, "request_too_large")
    assert_openai_error(api.post("/v1/speculation/override", b"[" * 5000), 413, "request_too_large")
    assert complete(api).status == 200


@pytest.mark.parametrize("body,param,code", [
    ({"prompt": "x" * 201}, "prompt", "context_length_exceeded"),
    ({"prompt": ["x" * 150, "y" * 60]}, "prompt", "context_length_exceeded"),
    ({"prompt": list(range(256))}, "prompt", "context_length_exceeded"),
    ({"max_tokens": 101}, "max_tokens", "invalid_value"),
    ({"stop": ["a", "b", "c"]}, "stop", "invalid_value"),
    ({"stop": "x" * 9}, "stop", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", "invalid_value"),
    ({"seed": 2**70}, "seed", "invalid_value"),
    ({"prompt": [-1]}, "prompt", None),
])
def test_request_limits(api, body, param, code):
    err = assert_openai_error(complete(api, **body), 400, code)
    assert err["param"] == param


def test_chat_limits(api):
    msg = {"role": "user", "content": "hi"}
    r = api.post("/v1/chat/completions", {"model": MODEL, "messages": [msg] * 5, "max_tokens": 2})
    assert assert_openai_error(r, 400)["param"] == "messages"
    r = api.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 201}]})
    assert assert_openai_error(r, 400, "context_length_exceeded")["param"] == "messages"
    r = api.post("/v1/chat/completions", {"model": MODEL, "messages": [msg], "max_completion_tokens": 101})
    assert assert_openai_error(r, 400)["param"] == "max_tokens"


def test_override_node_cap_is_bounded_by_the_engines(api):
    cap = api.args.max_tree_nodes
    override = api.api._controller.state
    try:
        r = api.post("/v1/speculation/override", {"budget": {"theta": 0.0, "node_cap": cap + 1, "branch_cap": 2}})
        err = assert_openai_error(r, 400, "invalid_value")
        assert err["param"] == "budget" and str(cap) in err["message"]
        r = api.post("/v1/speculation/override", {"budget": {"theta": 0.0, "node_cap": 10**9, "branch_cap": 2}})
        assert_openai_error(r, 400, "invalid_value")
        assert override.override is None  # nothing reached the controller
        r = api.post("/v1/speculation/override", {"budget": {"theta": 0.0, "node_cap": cap, "branch_cap": 2}})
        assert r.status == 200 and r.json()["override"]["node_cap"] == cap
        assert override.override is not None and override.override.node_cap == cap
    finally:
        assert api.post("/v1/speculation/override", {"budget": None}).status == 200
    assert override.override is None


def test_deep_json_is_400_not_500(api):
    assert_openai_error(api.post("/v1/completions", b"[" * 2000 + b"]" * 2000), 400, "invalid_json")
    assert_openai_error(api.post("/v1/completions", b"\xff\xfe"), 400, "invalid_json")


# -- overload and failures: clean errors ------------------------------------------------------

@pytest.mark.parametrize("status", [503, 429])
def test_backpressure_maps_to_openai_error_with_retry_after(api, status):
    api.handle.fail_next = [BackPressureError(64, 64, status, 2.5)]
    r = complete(api)
    assert_openai_error(r, status, "overloaded")
    assert r.headers["retry-after"] == "3"
    assert complete(api).status == 200


def test_replica_death_is_retried_then_503(api):
    api.handle.fail_next = [RayActorError(error_msg="The actor died: /secret-path/replica.py line 3")]
    n = api.handle.calls
    r = complete(api)
    assert r.status == 200 and api.handle.calls == n + 2  # resent to "another" replica
    api.handle.fail_next = [RayActorError(error_msg="/secret-path")] * 3   # limits.replica_retries = 2
    r = complete(api)
    assert_openai_error(r, 503, "replica_failed")
    assert r.headers["retry-after"] == "1"


class _BrokenEngine(FakeEngine):
    def step(self):
        raise RuntimeError('Traceback (most recent call last): File "/work/secret-path/engine.py", line 1')


def build_broken_engine(args):
    from serving.fake_engine import SamplingParams

    from deployments.replica.engine_factory import EngineBundle
    from deployments.replica.text import ByteTokenizer

    return EngineBundle(_BrokenEngine(args.vocab_size, args.max_batch_size, args.max_context), ByteTokenizer(args.vocab_size),
                        SamplingParams)


def test_internal_errors_do_not_leak(monkeypatch):
    a = LocalApi(_args(engine_factory="test_security:build_broken_engine"))
    try:
        err = assert_openai_error(complete(a), 500)
        assert "error id" in err["message"]
        r = complete(a, stream=True)  # the engine fails after the stream started: an SSE error event
        assert r.status in (200, 500)
        for leak in LEAKS:
            assert leak not in r.body.decode(), (leak, r.body)
        # an exception inside the API itself goes through the catch-all handler
        monkeypatch.setattr(a.api, "_engine_request", lambda req: 1 / 0 if "/secret-path" else None)
        err = assert_openai_error(complete(a), 500, "internal_error")
        assert "error id" in err["message"] and "ZeroDivision" not in err["message"]
    finally:
        a.close()


# -- deployment hygiene ---------------------------------------------------------------------

def test_binds_loopback_by_default():
    from ray.serve.config import HTTPOptions

    assert HTTPOptions().host == "127.0.0.1"
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        if "http_options" in cfg:
            assert cfg["http_options"].get("host", "127.0.0.1") == "127.0.0.1", path


def _serving_modules() -> list[Path]:
    import deployments.app  # noqa: F401
    import deployments.http.api  # noqa: F401
    import deployments.replica.replica  # noqa: F401
    import treespark.engine.core  # noqa: F401
    import treespark.models.pair  # noqa: F401

    files = [Path(m.__file__) for name, m in list(sys.modules.items())
             if name.split(".")[0] in ("treespark", "deployments") and getattr(m, "__file__", None)]
    return sorted(set(files))


def test_no_pickle_on_the_serving_path():
    files = _serving_modules()
    assert any(f.name == "pair.py" for f in files) and any(f.name == "replica.py" for f in files)
    for f in files:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib") for n in names), (f, node.lineno)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                base = node.func.value
                assert not (isinstance(base, ast.Name) and base.id in ("torch", "pickle")), (f, node.lineno)


def test_from_pretrained_requires_safetensors():
    for f in _serving_modules():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained":
                if "Tokenizer" in ast.unparse(node.func.value):
                    continue
                kws = {k.arg: k.value for k in node.keywords}
                assert "gguf_file" in kws or (
                    "use_safetensors" in kws and ast.literal_eval(kws["use_safetensors"]) is True), (f, node.lineno)

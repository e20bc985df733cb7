"""The whole service on a real Ray: OpenAI API, controller, budgets, scaling, failures.

One Serve app (real engine, random pair, two replicas, autoscaling to three) is
shared by every test in this module."""

import concurrent.futures as cf
import json
import time

import pytest
import requests
from serving.harness import serve_app, wait_for
from serving.policies import LADDER

from deployments.config import AppArgs, AutoscalingArgs, ControllerArgs, ReplicaArgs

pytestmark = pytest.mark.integration

MODEL = "treespark-random"
ARGS = AppArgs(
    model="random",
    vocab_size=512,
    max_batch_size=8,
    max_context=1024,
    policy=LADDER,
    replica=ReplicaArgs(num_cpus=0.5, torch_threads=1,
                        autoscaling=AutoscalingArgs(min_replicas=2, max_replicas=3, target_ongoing_requests=1,
                                                    upscale_delay_s=0, downscale_delay_s=600)),
    controller=ControllerArgs(name="treespark-test-controller", heartbeat_s=0.25, heartbeat_timeout_s=2.0),
)


@pytest.fixture(scope="module")
def url():
    with serve_app(ARGS) as u:
        yield u


def spec(url):
    r = requests.get(f"{url}/v1/speculation", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def spec_or_none(url):
    """The status, or None while the controller is (re)starting."""
    r = requests.get(f"{url}/v1/speculation", timeout=5)
    if r.status_code == 503:
        assert r.json()["error"]["code"] == "controller_unavailable"
        return None
    assert r.status_code == 200, r.text
    return r.json()


def complete(url, **kw):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0.0, **kw}
    return requests.post(f"{url}/v1/completions", json=body, timeout=60)


def sse_events(resp):
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            data = line[6:].decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def set_override(url, budget):
    r = requests.post(f"{url}/v1/speculation/override", json={"budget": budget}, timeout=5)
    assert r.status_code == 200, r.text


def all_applied(url, budget, n=2):
    reps = spec(url)["replicas"]
    return len(reps) >= n and all(r["applied_budget"] == budget and r["budget_source"] == "controller" for r in reps.values()) and reps


# -- the API --------------------------------------------------------------------------

def test_models_health(url):
    assert requests.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
    data = requests.get(f"{url}/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in data] == [MODEL]


def test_completion_openai_client(url):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(b"Once upon a time")
    spec_stats = r.model_extra["speculation"]
    assert spec_stats["rounds"] >= 1 and spec_stats["mean_tree_size"] is not None
    # greedy is deterministic across calls (and replicas)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.0)
    assert again.choices[0].text == r.choices[0].text


def test_completion_token_prompt_and_seeded_sampling(url):
    a = complete(url, prompt=[1, 2, 3], max_tokens=10, temperature=0.8, seed=7).json()
    b = complete(url, prompt=[1, 2, 3], max_tokens=10, temperature=0.8, seed=7).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["prompt_tokens"] == 3


def test_chat(url):
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 6, "temperature": 0}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "chat.completion" and j["choices"][0]["message"]["role"] == "assistant"
    assert j["usage"]["completion_tokens"] == 6 and "speculation" in j


def test_streaming_chat_and_completion(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = sse_events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 2  # incremental
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    # the streamed text equals the non-streamed text (greedy)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    body.pop("stream"), body.pop("stream_options")
    assert requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"] == text
    with requests.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 5, "stream": True}, stream=True, timeout=60) as r:
        ev = sse_events(r)
    assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_and_token_ids(url):
    full = complete(url, prompt="xyz", max_tokens=40).json()["choices"][0]["text"]
    cut = next((full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]), None)
    if cut is not None:
        r = complete(url, prompt="xyz", max_tokens=40, stop=[cut]).json()
        assert r["choices"][0]["text"] == full[: full.index(cut)] and r["choices"][0]["finish_reason"] == "stop"
    ids = complete(url, prompt=[5, 6], max_tokens=40).json()
    assert ids["choices"][0]["finish_reason"] == "length"


BAD = [
    ("/v1/completions", b"{not json", "invalid_json", None),
    ("/v1/completions", b"[1, 2]", "invalid_json", None),
    ("/v1/completions", {"prompt": "hi"}, "invalid_value", "model"),
    ("/v1/completions", {"model": MODEL}, "invalid_value", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, "invalid_value", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi" * 505, "max_tokens": 16}, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi" * 505}, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "h" * 1100, "max_tokens": 1}, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}, None, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, None, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, "invalid_value", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "invalid_value", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "invalid_value", "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 500}, "invalid_value", "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, "unsupported_parameter", "echo"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "invalid_value", "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "invalid_value", "stop"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model_not_found", "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "invalid_value", "max_tokens"),
]


def test_bad_input_gets_openai_4xx(url):
    for path, body, code, param in BAD:
        kw = {"data": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = requests.post(f"{url}{path}", timeout=30, **kw)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        if code is not None:
            assert err["code"] == code, (body, err)
        assert err["param"] == param, (body, err)
    assert requests.get(f"{url}/v1/nope", timeout=5).json()["error"]["type"] == "not_found_error"
    assert complete(url).status_code == 200  # and the service is still fine


def test_client_disconnect_aborts_in_engine(url):
    before = spec(url)["counters"]["requests_aborted"]
    body = {"model": MODEL, "prompt": "tell me everything", "max_tokens": 1000, "stream": True, "temperature": 0}
    r = requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60)
    lines = r.iter_lines()
    assert next(x for x in lines if x.startswith(b"data: "))
    r.close()
    s = wait_for(lambda: (x := spec(url))["counters"]["requests_aborted"] > before and x, timeout=10)
    wait_for(lambda: sum(rep["active"] + rep["queued"] for rep in spec(url)["replicas"].values()) == 0, timeout=10)
    assert s["counters"]["generation_tokens"] > 0


# -- controller, budgets, metrics ------------------------------------------------------

def test_two_replicas_registered_with_tree_stats(url):
    for _ in range(4):
        assert complete(url, max_tokens=16).status_code == 200
    s = wait_for(lambda: (x := spec(url)) and len(x["replicas"]) >= 2 and x, timeout=20)
    for r in s["replicas"].values():
        assert r["budget_source"] == "controller"
        assert {"theta", "mean_tree_size", "mean_width", "accepted_per_round", "batch_size"} <= set(r)
    assert s["cluster"]["replicas"] >= 2


def test_budget_change_reaches_all_replicas(url):
    """Every replica applies an operator's budget from the controller's answer to one of
    its next heartbeats (a few per second; the timeout is for a loaded machine)."""
    for budget in ({"theta": 0.3, "node_cap": 3, "branch_cap": 1}, {"theta": 0.05, "node_cap": 9, "branch_cap": 3}):
        set_override(url, budget)
        wait_for(lambda b=budget: all_applied(url, b), timeout=30, interval=0.05)
    # the engines really run it: a round never drafts more than node_cap
    r = complete(url, max_tokens=20).json()["speculation"]
    assert r["mean_tree_size"] <= 9
    set_override(url, None)


def test_the_price_source_reaches_all_replicas(url):
    """``POST /v1/speculation/pricing``: every replica runs a budget priced on its own queue,
    then on the cluster's again, each within a few heartbeats."""
    try:
        for cluster, source in ((False, "local"), (True, "cluster")):
            r = requests.post(f"{url}/v1/speculation/pricing", json={"cluster": cluster}, timeout=5)
            assert r.status_code == 200 and r.json() == {"cluster": cluster}, r.text
            wait_for(lambda s=source: (x := spec(url))["price_source"] == s and len(x["replicas"]) >= 2
                     and all(rep["price_source"] == s for rep in x["replicas"].values()), timeout=30, interval=0.05)
    finally:
        requests.post(f"{url}/v1/speculation/pricing", json={"cluster": True}, timeout=5)


def test_metrics_prometheus(url):
    complete(url)
    wait_for(lambda: "treespark:request_success_total{" in requests.get(f"{url}/metrics", timeout=5).text, 5)
    text = requests.get(f"{url}/metrics", timeout=5).text
    for name in ("treespark:request_success_total", "treespark:prompt_tokens_total", "treespark:generation_tokens_total",
                 "treespark:spec_decode_num_accepted_tokens_total", "treespark:spec_decode_theta",
                 "treespark:spec_decode_mean_tree_size", "treespark:step_time_seconds",
                 "treespark:time_to_first_token_seconds", "treespark:spec_decode_num_accepted_tokens_per_pos_total",
                 "treespark:spec_decode_mode", "treespark:controller_broadcast_age_seconds",
                 "treespark:kv_cache_usage_perc", "treespark:prefix_cache_queries", "treespark:prefix_cache_hits",
                 "treespark:num_preemptions"):
        assert f"# TYPE {name}" in text
    total = [x for x in text.splitlines() if x.startswith("treespark:request_success_total")]
    assert float(total[0].split()[-1]) >= 1

    def series(name):
        return [float(x.split()[-1]) for x in requests.get(f"{url}/metrics", timeout=5).text.splitlines()
                if x.startswith(name + "{")]

    # the engines looked up the prompt tokens they admitted (a heartbeat may lag the engine by a step)
    wait_for(lambda: series("treespark:prefix_cache_queries_total")[0] > 0, 10)
    assert series("treespark:prefix_cache_hits_total")[0] <= series("treespark:prefix_cache_queries_total")[0]
    assert all(0.0 <= u <= 1.0 for u in series("treespark:kv_cache_usage_perc"))


def test_served_openapi_document(url):
    doc = requests.get(f"{url}/openapi.json", timeout=5).json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatRequest") and "ChatRequest" in doc["components"]["schemas"]


def test_scale_up_replica_receives_budget(url):
    budget = {"theta": 0.2, "node_cap": 2, "branch_cap": 1}
    set_override(url, budget)
    wait_for(lambda: all_applied(url, budget), timeout=3)
    before = set(spec(url)["replicas"])
    body = {"model": MODEL, "prompt": "load", "max_tokens": 1000, "stream": True, "temperature": 0}
    streams = [requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) for _ in range(6)]
    try:
        new = wait_for(lambda: set(spec(url)["replicas"]) - before, timeout=60, interval=0.25)
        (rid,) = new
        # the new replica runs the pinned budget, from the controller, not its local policy
        wait_for(lambda: (rep := spec(url)["replicas"].get(rid)) and rep["applied_budget"] == budget
                 and rep["budget_source"] == "controller", timeout=30, interval=0.05)
    finally:
        for s in streams:
            s.close()
        set_override(url, None)


def test_controller_killed_service_continues_and_replicas_reregister(url):
    import ray

    name, ns = ARGS.controller.name, ARGS.controller.namespace
    n = len(spec(url)["replicas"])
    # 1) killed and restarted by Ray (state reset)
    t_kill = time.time()
    ray.kill(ray.get_actor(name, namespace=ns), no_restart=False)
    with cf.ThreadPoolExecutor(4) as ex:
        codes = list(ex.map(lambda _: complete(url, max_tokens=8).status_code, range(6)))
    assert codes == [200] * 6
    # a fresh controller (started after the kill) that every replica registered with
    wait_for(lambda: (x := spec_or_none(url)) and len(x["replicas"]) >= n
             and x["uptime_s"] <= time.time() - t_kill and x, timeout=60)
    # 2) killed for good: replicas keep serving on the local policy and bring it back
    t_kill = time.time()
    ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)
    assert all(complete(url, max_tokens=8).status_code == 200 for _ in range(3))
    wait_for(lambda: (x := spec_or_none(url)) and len(x["replicas"]) >= n and x["uptime_s"] <= time.time() - t_kill
             and all(r["budget_source"] == "controller" for r in x["replicas"].values()) and x, timeout=60)

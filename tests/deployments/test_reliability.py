"""Reliability on a real Ray Serve app (real engine, random pair, two replicas): overload
answered at once with 503 + Retry-After, a client that disconnects frees its KV row,
a replica killed mid-run (its streams resumed on the survivor with the same tokens, its
other requests re-sent; a new replica registers), the controller killed under load (no request fails), and 500 fuzzed
requests (``test_fuzz``'s strategies) without a 5xx."""

import asyncio
import concurrent.futures as cf
import json
import threading
import time

import pytest
import requests
from serving.harness import serve_app, wait_for
from serving.policies import LADDER

from deployments.config import AppArgs, ControllerArgs, LimitArgs, ReplicaArgs
from loadtests.common import get_status as spec
from loadtests.common import is_idle

pytestmark = pytest.mark.integration

MODEL = "treespark-random"
ARGS = AppArgs(
    model="random", vocab_size=512, max_batch_size=4, max_context=4096, default_max_tokens=16, policy=LADDER,
    replica=ReplicaArgs(num_cpus=0.5, num_replicas=2, torch_threads=1, max_ongoing_requests=4, max_queued_requests=4,
                        retry_after_s=2),
    controller=ControllerArgs(name="treespark-reliability-controller", heartbeat_s=0.25, heartbeat_timeout_s=2.0),
    # a request resumed on the survivor of a kill may queue there behind whole streams
    limits=LimitArgs(queue_timeout_s=300),
)


@pytest.fixture(scope="module")
def url():
    with serve_app(ARGS) as u:
        yield u


def idle(url):
    """The status once every replica reports an empty engine and an empty KV cache."""
    s = spec(url)
    return s if is_idle(s) else None


HANG_S = 600  # a read that waits this long has hung: a guard, not a speed bound


def complete(url, max_tokens=8, stream=False, timeout=60):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout, stream=stream)


def test_backpressure_503_retry_after_without_waiting_for_a_slot(url):
    """8 ongoing + 4 queued fit; the rest are refused at once, never left hanging: every
    refusal is answered before any admitted request has finished (all 24 leave together)."""
    start = threading.Barrier(24, timeout=60)

    def one(_):
        start.wait()
        r = complete(url, max_tokens=300, stream=True)
        if r.status_code == 200:  # admitted: served to the end
            text = "".join(x.decode() for x in r.iter_lines())
            assert text.endswith("data: [DONE]"), text[-200:]
        else:
            text = r.raw.read().decode()
        r.close()
        return r.status_code, time.monotonic(), r.headers.get("retry-after"), text

    with cf.ThreadPoolExecutor(24) as ex:
        out = list(ex.map(one, range(24)))
    refused = [o for o in out if o[0] != 200]
    served = [o for o in out if o[0] == 200]
    assert refused and len(served) >= 8, [o[0] for o in out]
    for status, _, retry, text in refused:
        body = json.loads(text)
        assert status == 503 and retry == "2" and body["error"]["code"] == "overloaded", (status, retry, body)
    assert max(t for _, t, _, _ in refused) < min(t for _, t, _, _ in served)
    wait_for(lambda: idle(url), timeout=60, interval=0.25)


def test_client_disconnect_frees_kv(url):
    before = spec(url)["counters"]["requests_aborted"]
    streams = [complete(url, max_tokens=4000, stream=True) for _ in range(3)]
    lines = [r.iter_lines() for r in streams]  # kept: a dropped line iterator closes its connection
    for it in lines:
        assert next(x for x in it if x.startswith(b"data: "))
    wait_for(lambda: (x := spec(url)) and sum(r["active"] for r in x["replicas"].values()) == 3
             and sum(r["kv_cache_usage"] or 0 for r in x["replicas"].values()) > 0 and x, timeout=30, interval=0.05)
    for r in streams:
        r.close()
    s = wait_for(lambda: idle(url), timeout=60, interval=0.1)
    assert s["counters"]["requests_aborted"] >= before + 3


def _replica_actors():
    import ray

    return {a["name"].rsplit("#", 1)[-1]: a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::treespark#Replica#")}


def ingress_counters(url):
    """The API's counters of resends, resumed and failed streams, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text):
        for smp in fam.samples:
            if smp.name in ("treespark:request_retries_total", "treespark:stream_resumes_total",
                            "treespark:stream_resume_seconds_sum"):
                out[smp.name.split(":")[1]] = smp.value
            elif smp.name == "treespark:stream_failures_total":
                out["stream_failures_total"] = out.get("stream_failures_total", 0) + smp.value
    return out


def test_kill_replica_midrun(url):
    """A replica killed under streaming and non-streaming requests: every stream that had
    started goes on to the end on the survivor (resumed where it was: no error event, the
    same greedy text as every other stream, usage counting each token once), every
    non-streamed request is answered (re-sent) or cleanly refused."""
    import ray
    from ray import serve

    reps = wait_for(lambda: (x := spec(url)) and len(x["replicas"]) == 2 and x["replicas"], timeout=20)
    actors = _replica_actors()
    assert set(actors) == set(reps), (actors, reps)
    before = ingress_counters(url)
    n_streams, n_plain, stream_tokens = 3, 3, 1200
    started = threading.Semaphore(0)   # one release per stream that has received text

    def stream_one(_):
        t0 = time.time()
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": stream_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        events, told = [], False
        with requests.post(f"{url}/v1/completions", json=body, timeout=(10, HANG_S), stream=True) as r:
            if r.status_code != 200:  # refused (the survivor is full) before it started
                started.release()
                return r.status_code, time.time() - t0, json.loads(r.raw.read())
            for x in r.iter_lines():
                if x.startswith(b"data: "):
                    events.append(json.loads(x[6:]) if x != b"data: [DONE]" else "[DONE]")
                    if not told and isinstance(events[-1], dict) and (events[-1].get("choices") or [{}])[0].get("text"):
                        told = True
                        started.release()
        if not told:
            started.release()
        return r.status_code, time.time() - t0, events

    def plain_one(_):
        # nothing arrives before the whole answer: a request resent to the survivor, which
        # serves all of them, takes as long as the machine needs, so the read timeout
        # only guards against a hang
        t0 = time.time()
        r = complete(url, max_tokens=stream_tokens // 2, timeout=(10, HANG_S))
        return r.status_code, time.time() - t0, r.json()

    with cf.ThreadPoolExecutor(n_streams + n_plain) as ex:
        streams = [ex.submit(stream_one, i) for i in range(n_streams)]
        plains = [ex.submit(plain_one, i) for i in range(n_plain)]
        for _ in range(n_streams):   # every stream under way (text received) before the kill
            assert started.acquire(timeout=HANG_S)
        busy = wait_for(lambda: (x := spec(url)) and [rid for rid, r in x["replicas"].items() if r["active"] > 0], timeout=10)
        victim = busy[0]
        ray.kill(ray.get_actor(actors[victim], namespace="serve"), no_restart=True)
        s_out = [f.result() for f in streams]   # each bounded by its own read timeout
        p_out = [f.result() for f in plains]
    texts = []
    for status, _dt, events in s_out:
        if status == 503:  # refused before it began: not in flight at the kill
            assert events["error"]["code"] in ("overloaded", "replica_failed"), events
            continue
        assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1, (status, events[-3:])
        assert not any("error" in e for e in events[:-1]), [e for e in events[:-1] if "error" in e]
        assert len({e["id"] for e in events[:-1]}) == 1 and len({e["created"] for e in events[:-1]}) == 1
        assert events[-2]["usage"]["completion_tokens"] == stream_tokens
        texts.append("".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]))
    assert texts and len(set(texts)) == 1, [len(t) for t in texts]   # greedy: one text, resumed or not
    for status, _dt, body in p_out:  # non-streaming: resent to the other replica, or a clean 503
        assert status == 200 or (status == 503 and body["error"]["code"] in ("overloaded", "replica_failed")), (status, body)
        if status == 200:   # a prefix of the streams' greedy text (a cut may drop a partial character)
            assert texts[0].startswith(body["choices"][0]["text"][:-2])
    after = ingress_counters(url)
    assert after["request_retries_total"] > before["request_retries_total"]   # the victim held requests
    assert after["stream_failures_total"] == before["stream_failures_total"]
    resumes = after["stream_resumes_total"] - before["stream_resumes_total"]
    pause = (after["stream_resume_seconds_sum"] - before["stream_resume_seconds_sum"]) / max(resumes, 1)
    print(f"killed {victim}: {resumes:.0f}/{n_streams} streams resumed (mean pause {pause:.1f} s), "
          f"{after['request_retries_total'] - before['request_retries_total']:.0f} re-issues, stream statuses "
          f"{[x[0] for x in s_out]}, plain statuses {[x[0] for x in p_out]}, all answered within "
          f"{max(x[1] for x in s_out + p_out):.1f} s")
    # the survivors kept serving, and Serve replaces the dead replica, which registers
    assert complete(url).status_code == 200

    def replaced():
        st = serve.status().applications["treespark"].deployments["Replica"]
        x = spec(url)
        new = x and set(x["replicas"]) - set(reps)
        return st.replica_states.get("RUNNING", 0) == 2 and new and victim not in x["replicas"] and new
    new = wait_for(replaced, timeout=90, interval=0.5)
    assert len(new) == 1
    wait_for(lambda: idle(url), timeout=20, interval=0.25)


def test_kill_controller_under_load(url):
    """Clients keep getting answers while the controller is killed and restarted by Ray,
    then killed for good and re-created by the replicas; every answer is a 200."""
    import ray

    name, ns = ARGS.controller.name, ARGS.controller.namespace
    stop = threading.Event()
    codes: list[int] = []

    def client():
        while not stop.is_set():
            codes.append(complete(url, max_tokens=16).status_code)

    def answers(more: int) -> None:
        """Until the clients have ``more`` answers beyond those they have now."""
        n = len(codes) + more
        wait_for(lambda: len(codes) >= n, timeout=120, interval=0.05)

    def fresh_controller(t_kill: float):
        """Both replicas registered with a controller started after ``t_kill``."""
        return wait_for(lambda: (x := spec(url)) and len(x["replicas"]) == 2 and x["uptime_s"] <= time.time() - t_kill
                        and all(r["budget_source"] == "controller" for r in x["replicas"].values()) and x,
                        timeout=60, interval=0.1)

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        answers(3)
        t_kill = time.time()
        ray.kill(ray.get_actor(name, namespace=ns), no_restart=False)  # restarted by Ray, state reset
        answers(3)
        fresh_controller(t_kill)
        t_kill = time.time()
        ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)   # gone for good: replicas recreate it
        answers(3)
        fresh_controller(t_kill)
        answers(3)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert len(codes) >= 12 and set(codes) == {200}, codes


def test_fuzz_served_app(url):
    """The property of ``test_fuzz`` through the whole served stack: proxy, API replica,
    handles, engine replicas. 250 generated requests, none answered 5xx."""
    from hypothesis import given, settings
    from test_fuzz import FUZZ, check, requests_

    seen: dict[int, int] = {}

    @settings(FUZZ, max_examples=250)
    @given(requests_)
    def run(req):
        method, path, body = req
        if path.startswith("/v1/speculation/"):  # a valid override or pricing switch would change the other tests
            path = "/v1/completions"
        r = requests.request(method, url + path, data=body.encode() if isinstance(body, str) else body,
                             headers={"content-type": "application/json"}, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        check(r.status_code, r.content, req)

    run()
    print("served fuzz statuses:", dict(sorted(seen.items())))
    assert sum(seen.values()) >= 200 and not any(s >= 500 for s in seen) and seen.get(200, 0) >= 15
    wait_for(lambda: idle(url), timeout=20, interval=0.25)


def test_disconnect_mid_stream_frees_kv_inprocess():
    """The same without Ray: the API and replica core in-process over the real engine; the
    client leaves after three SSE chunks of a 2000-token completion."""
    from serving.inprocess import LocalApi

    a = LocalApi(AppArgs(model="random", vocab_size=512, max_batch_size=2, max_context=2048, policy=LADDER))
    try:
        engine = a.core.bundle.engine
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        r = a.post("/v1/completions", body, disconnect_after=3)
        assert r.status == 200 and "[DONE]" not in r.sse()
        deadline = time.time() + 60  # generous: the loop ends as soon as the engine is empty
        while time.time() < deadline and (engine.kv_rows_in_use or engine.num_running or engine.num_waiting
                                          or not a.core.counters["requests_aborted"]):
            a.loop.run_until_complete(asyncio.sleep(0.02))
        assert engine.kv_rows_in_use == 0 and engine.num_running == 0 and engine.num_waiting == 0
        assert a.core.counters["requests_aborted"] == 1 and a.core.counters["requests"] == 0
        assert a.core.counters["generation_tokens"] < 2000  # cut off mid-generation
        # and the engine serves the next request
        assert a.post("/v1/completions", {**body, "stream": False, "max_tokens": 8}).json()["usage"]["completion_tokens"] == 8
    finally:
        a.close()

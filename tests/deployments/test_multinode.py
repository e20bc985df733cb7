"""The service on a multi-node Ray cluster (``loadtests.cluster``): a head and two worker
nodes on this machine, each its own raylet with its own resources.

Replicas ask for the workers' custom resource, so they run on workers only; the
controller and the API ingress are pinned to the head (``deployments.placement``: the
head outlives workers). Killing a worker: the controller drops its replica within its
heartbeat timeout, Serve starts a replacement on the surviving worker, which registers
and gets its budget, and requests keep being answered."""

import time

import pytest
import requests
from serving.harness import wait_for
from serving.policies import LADDER

from deployments.config import AppArgs, ControllerArgs, ReplicaArgs
from loadtests.cluster import WORKER_RESOURCE, ClusterSpec, local_cluster

pytestmark = pytest.mark.integration

MODEL = "treespark-random"
TIMEOUT_S = 2.0
ARGS = AppArgs(model="random", vocab_size=512, max_batch_size=4, max_context=256, policy=LADDER,
               replica=ReplicaArgs(num_cpus=0.5, torch_threads=1, num_replicas=2, resources={WORKER_RESOURCE: 1}),
               controller=ControllerArgs(name="treespark-multinode-test", heartbeat_s=0.25,
                                         heartbeat_timeout_s=TIMEOUT_S))


@pytest.fixture(scope="module")
def cl():
    from deployments.app import build_app

    spec = ClusterSpec(workers=2, http_port=8210, gcs_port=6410, agent_port_base=6420)
    with local_cluster(spec, lambda: build_app(ARGS)) as c:
        yield c


def status(url):
    r = requests.get(f"{url}/v1/speculation", timeout=5)
    return r.json() if r.status_code == 200 else None


def complete(url):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0.0}
    return requests.post(f"{url}/v1/completions", json=body, timeout=60)


def test_placement_and_a_lost_worker(cl):
    url = cl.url
    st = wait_for(lambda: (s := status(url)) and len(s["replicas"]) == 2 and s, 120)
    assert st["controller_node_id"] == cl.head_id                          # the controller on the head
    nodes = {r["node_id"] for r in st["replicas"].values()}
    assert nodes <= set(cl.workers) and cl.head_id not in nodes             # replicas on workers only
    for r in st["replicas"].values():
        assert r["budget_source"] == "controller" and r["first_budget_s"] < 1.0
    assert complete(url).status_code == 200

    # lose the worker that holds a replica (the first; with Serve's spread both may hold one)
    victim = next(iter(nodes))
    (dead,) = [rid for rid, r in st["replicas"].items() if r["node_id"] == victim][:1]
    t_kill = cl.kill_worker(victim)
    # the controller drops it once it has been silent for the heartbeat timeout
    wait_for(lambda: (s := status(url)) and dead not in s["replicas"], TIMEOUT_S + 2.0, 0.05)
    dropped_after = time.time() - t_kill
    assert dropped_after < TIMEOUT_S + 1.0
    # Serve replaces it on the surviving worker; the newcomer registers and gets its budget
    (alive,) = cl.workers
    st = wait_for(lambda: (s := status(url)) and len(s["replicas"]) == 2
                  and all(r["budget_source"] == "controller" for r in s["replicas"].values()) and s, 120, 0.25)
    assert {r["node_id"] for r in st["replicas"].values()} == {alive}
    assert all(r["first_budget_s"] < 1.0 for r in st["replicas"].values())
    assert st["dropped"] >= 1
    for _ in range(4):
        assert complete(url).status_code == 200

"""A multi-node Ray cluster on one machine, with the service on it (tests and experiments).

``local_cluster`` starts a head node and ``workers`` worker nodes as separate raylets
(``ray.cluster_utils.Cluster``), each with its own CPUs and a custom resource
(``WORKER_RESOURCE``) that the service's replicas ask for, so replicas run only on
workers; the controller and the API ingress are pinned to the head
(``deployments.placement``), and Serve's HTTP proxy stays there (``HeadOnly``: every
node of this cluster shares the loopback, so proxies on every node would fight over
the port). ``kill_worker`` removes a worker at once (SIGKILL to its raylet and
processes), as a lost machine.

The head runs with a shorter node health check than Ray's default (about 15 s before a
silent node is declared dead) so that Serve replaces a lost worker's replicas within
seconds; ``HEALTH_CHECK`` states it. Only the GCS port and the agents' ports are fixed
(``ClusterSpec``); everything else picks a free port. The Ray address file that
``Cluster`` writes for ``ray.init()`` is removed, so that no other ``ray.init()`` or
``serve run`` on this machine joins this cluster by accident.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from loadtests.common import ROOT, log, wait_healthy

WORKER_RESOURCE = "treespark_worker"
# Ray's node failure detection: period x threshold before a silent raylet is declared dead
HEALTH_CHECK = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 500,
                "health_check_failure_threshold": 4}


@dataclass(frozen=True)
class ClusterSpec:
    workers: int = 2
    worker_cpus: float = 1.0
    replicas_per_worker: int = 2      # WORKER_RESOURCE units each worker offers
    gcs_port: int = 6410
    agent_port_base: int = 6420       # head and workers' dashboard / metrics agents: base + 3 i ...
    http_port: int = 8210
    env: dict[str, str] = field(default_factory=dict)   # extra environment of every Ray process


@dataclass
class LocalCluster:
    cluster: Any
    url: str
    head_id: str
    workers: dict[str, Any]          # node id -> ray._private.node.Node
    spec: ClusterSpec
    killed: list[tuple[float, str]] = field(default_factory=list)   # (time.time(), node id)
    _next: int = 0

    def add_worker(self) -> str:
        i = self._next
        self._next += 1
        base = self.spec.agent_port_base + 3 * (i + 1)
        node = self.cluster.add_node(num_cpus=self.spec.worker_cpus,
                                     resources={WORKER_RESOURCE: float(self.spec.replicas_per_worker)},
                                     dashboard_agent_listen_port=base, metrics_export_port=base + 1,
                                     metrics_agent_port=base + 2)
        self.workers[node.node_id] = node
        return node.node_id

    def kill_worker(self, node_id: str) -> float:
        """SIGKILL the worker's raylet and processes; returns once they are gone, with the
        time the kill was issued (time.time())."""
        node = self.workers.pop(node_id)
        t = time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        self.killed.append((t, node_id))
        return t


def _forget_address(address: str) -> None:
    import ray._private.utils as ru

    path = ru.get_ray_address_file(None)
    with contextlib.suppress(OSError):
        with open(path) as f:
            if f.read().strip() == address:
                os.unlink(path)


@contextlib.contextmanager
def local_cluster(spec: ClusterSpec, build: Callable[[], Any] | None = None,
                  ready_timeout_s: float = 240.0) -> Iterator[LocalCluster]:
    """Head + ``spec.workers`` workers, Serve (HTTP on ``spec.http_port``) and the Serve
    application ``build()`` returns (built once connected: ``build_app`` creates the
    controller), healthy; everything torn down afterwards."""
    env = {"RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **spec.env}
    with mock.patch.dict(os.environ, env):
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        b = spec.agent_port_base
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "gcs_server_port": spec.gcs_port, "include_dashboard": False,
            "dashboard_agent_listen_port": b, "metrics_export_port": b + 1, "metrics_agent_port": b + 2,
            "_system_config": HEALTH_CHECK})
        _forget_address(cluster.address)
        try:
            lc = LocalCluster(cluster, f"http://127.0.0.1:{spec.http_port}", cluster.head_node.node_id, {}, spec)
            for _ in range(spec.workers):
                lc.add_worker()
            ray.init(address=cluster.address, logging_level="WARNING")
            log(f"cluster up: head {lc.head_id[:8]}, workers {[n[:8] for n in lc.workers]}")
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": spec.http_port})
            if build is not None:
                serve.run(build(), name="treespark", route_prefix="/")
                wait_healthy(lc.url, ready_timeout_s)
            yield lc
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            cluster.shutdown()

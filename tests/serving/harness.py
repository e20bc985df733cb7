"""Start a real Ray (in-process, loopback, 2 CPUs) and one Serve app for a test module."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import requests

from deployments.config import AppArgs
from loadtests.common import wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(args: AppArgs) -> Iterator[str]:
    """Yields the base URL of a running app; tears Serve and Ray down afterwards."""
    env = {
        "RAY_AUTH_MODE": "disabled",
        # workers import deployments/ from this checkout, installed or not
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        # autoscaling decisions within seconds, for the scaling test
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    }
    with mock.patch.dict(os.environ, env):
        import ray
        from ray import serve

        from deployments.app import build_app

        port = _free_port()
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
                 runtime_env={"env_vars": env}, logging_level="WARNING")
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(args), name="treespark", route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, timeout_s=120)
            yield url
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


def wait_for(pred, timeout: float, interval: float = 0.05):
    """Polls ``pred`` until it returns a truthy value; returns it, or raises after ``timeout``."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        with contextlib.suppress(requests.RequestException):
            last = pred()
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last: {last!r})")

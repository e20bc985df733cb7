"""The engine replica deployment: ``Replica``, one ``ReplicaCore`` per Serve replica.

The core (``deployments.replica.core``) handles requests over continuous batching;
its heartbeat (``deployments.replica.heartbeat``) reports to the controller; the engine comes
from ``AppArgs.engine_factory`` (default ``build_engine``, ``deployments.replica.engine_factory``).
This module is only the Serve wrapper.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from deployments.config import AppArgs
from deployments.replica.core import ReplicaCore


@serve.deployment(name="Replica", max_ongoing_requests=64, health_check_period_s=5)
class Replica:
    """Serve deployment around ``ReplicaCore``; resources and scaling come from ``AppArgs``."""

    def __init__(self, args: dict[str, Any]) -> None:
        from deployments.controller.controller import get_or_create_controller

        a = AppArgs.model_validate(args)
        ctx = serve.get_replica_context()
        rid = str(getattr(ctx.replica_id, "unique_id", ctx.replica_id))
        node = ray.get_runtime_context().get_node_id()
        self.core = ReplicaCore(a, rid, connect=lambda: get_or_create_controller(args), node_id=node)

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for event in self.core.generate(req):
            yield event

    def status(self) -> dict[str, Any]:
        return self.core.status()

    def check_health(self) -> None:
        # a model that could not load is not a failure a restart fixes: the replica stays up and
        # answers 503 with the reason (ReplicaCore.startup_error) instead of crash-looping
        if self.core.startup_error is None and not self.core.loop.alive:
            raise RuntimeError("engine loop thread died")

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()

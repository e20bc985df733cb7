"""The typed Serve application builder: ``serve run configs/cluster.yaml`` calls
``build_app`` with the validated ``AppArgs``.

The graph: ``Api`` (HTTP ingress, no CPU) -> ``Replica`` (one engine each, scaled by
Serve) ; both talk to one named, detached ``Controller`` actor, created here when Ray
is up (and by any replica that finds it gone). The ingress and the controller run on
the head node, the replicas where their resources are (``deployments.placement``)."""

from typing import Any

import ray
from ray.serve import Application

from deployments.config import AppArgs
from deployments.controller.controller import get_or_create_controller
from deployments.http.api import Api
from deployments.placement import on_head
from deployments.replica.replica import Replica


def replica_options(args: AppArgs) -> dict[str, Any]:
    r = args.replica
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus,
                              **({"resources": dict(r.resources)} if r.resources else {})},
        # a batch running and one waiting in the engine, per replica
        "max_ongoing_requests": r.max_ongoing_requests or 2 * args.max_batch_size,
        # beyond this many waiting in the caller (the API): BackPressureError -> 503/429 + Retry-After
        "max_queued_requests": r.max_queued_requests,
        "backpressure_config": {"status_code": r.backpressure_status, "retry_after_s": r.retry_after_s},
    }
    if r.autoscaling is not None:
        a = r.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
        }
    else:
        opts["num_replicas"] = r.num_replicas or 1
    return opts


def build_app(args: AppArgs) -> Application:
    # (no `from __future__ import annotations` here: Serve reads this annotation to
    # validate the YAML args into AppArgs)
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    wire = args.wire()
    replica = Replica.options(**replica_options(args)).bind(wire)
    if ray.is_initialized():
        controller = get_or_create_controller(wire)
        ray.get(controller.configure.remote(wire), timeout=30)
    return Api.options(ray_actor_options=on_head({"num_cpus": 0})).bind(replica, wire)

"""The cluster controller: one named, detached Ray actor that prices speculation.

Replicas call ``report`` every ``heartbeat_s`` with their load and recent tree
statistics; the reply carries the budget the replica must run (so a budget change
reaches every replica within one heartbeat, well under a second). The rules and the
math live in ``ControllerState`` (``deployments.controller.state``), the heartbeat
wire format in ``deployments.reports`` and the online fits in
``treespark.pricing.estimators``, all testable without Ray; ``Controller`` is the thin
actor around the state. Importing this module loads no torch.
"""

from __future__ import annotations

from typing import Any

from deployments.controller.state import ControllerState
from deployments.placement import on_head
from deployments.reports import ReplicaReport
from treespark.pricing.estimators import RoundWindow
from treespark.spec.budget import Budget


class Controller:
    """The Ray actor (``ray.remote`` applied in ``get_or_create_controller``)."""

    def __init__(self, args: dict[str, Any]) -> None:
        from deployments.config import AppArgs

        a = AppArgs.model_validate(args)
        self.state = ControllerState(
            policy=a.policy.build(a.max_batch_size),
            heartbeat_timeout_s=a.controller.heartbeat_timeout_s,
            online_calibration=a.controller.online_calibration,
            min_calibration_records=a.controller.min_calibration_records,
            calibration_prior_records=a.controller.calibration_prior_records,
            rounds=RoundWindow(max_nodes=a.max_tree_nodes),
            cluster_pricing=a.controller.pricing,
        )

    def configure(self, args: dict[str, Any]) -> None:
        """A redeploy with new arguments updates the policy of a running controller (and
        its price source to the config's, whatever ``set_pricing`` chose since)."""
        from deployments.config import AppArgs

        a = AppArgs.model_validate(args)
        s = self.state
        s.policy, s.heartbeat_timeout_s = a.policy.build(a.max_batch_size), a.controller.heartbeat_timeout_s
        s.online_calibration, s.min_calibration_records = a.controller.online_calibration, a.controller.min_calibration_records
        s.calibration_prior_records = a.controller.calibration_prior_records
        s.cluster_pricing = a.controller.pricing
        if s.rounds.max_nodes != a.max_tree_nodes:  # records are keyed by node caps up to it
            s.rounds = RoundWindow(max_nodes=a.max_tree_nodes)
        s.reassign()

    def report(self, report: dict[str, Any]) -> dict[str, Any]:
        return self.state.report(ReplicaReport.from_wire(report))

    def report_ingress(self, ingress_id: str, samples: list) -> None:
        self.state.report_ingress(ingress_id, samples)

    def set_override(self, budget: dict[str, Any] | None, fixed: bool = False) -> None:
        self.state.set_override(None if budget is None else Budget.from_wire(budget), fixed)

    def set_pricing(self, cluster: bool) -> None:
        self.state.set_pricing(cluster)

    def status(self) -> dict[str, Any]:
        import ray

        return {**self.state.status(), "controller_node_id": ray.get_runtime_context().get_node_id()}

    def metrics_view(self) -> dict[str, Any]:
        return self.state.metrics_view()


def get_or_create_controller(args: dict[str, Any]):
    """The controller actor handle, creating it if absent (idempotent, race-free through
    ``get_if_exists``). Detached so it outlives any one replica; restarted by Ray if it
    dies (state reset; replicas re-register on their next heartbeat). Pinned to the head
    node (``deployments.placement``: why)."""
    import ray

    from deployments.config import AppArgs

    c = AppArgs.model_validate(args).controller
    actor = ray.remote(Controller).options(
        name=c.name,
        namespace=c.namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=0,
        num_cpus=0,
        resources=on_head({})["resources"],
    )
    return actor.remote(args)

"""Where the service's actors run on a multi-node Ray cluster.

* The **controller** and the **API ingress** run on the head node. The head lives as long
  as the cluster (the GCS, Serve's own controller and the HTTP proxy, with
  ``proxy_location: HeadOnly``, are there too), while worker nodes come and go with
  autoscaling and failures. On a worker, the controller would die with it: Ray restarts
  it elsewhere, but with its state reset (override, online calibration, the departed
  replicas' metric totals), and requests in the ingress would fail. Neither needs a CPU
  or a GPU, so they fit a KubeRay head started with ``num-cpus: "0"``. Ray marks the
  head with the resource ``node:__internal_head__``; asking for a sliver of it pins an
  actor there without any cluster configuration (Ray Train pins its state actor so).
* **Engine replicas** go wherever their resources are: ``ReplicaArgs.num_gpus`` on a GPU
  cluster, and ``ReplicaArgs.resources`` (custom resources a node was started with,
  e.g. ``ray start --resources='{"treespark_worker": 2}'``) to keep them on chosen nodes.
"""

from __future__ import annotations

from typing import Any

HEAD_NODE_RESOURCE = "node:__internal_head__"
HEAD_SLIVER = 0.001   # any amount pins; a sliver never runs out


def on_head(actor_options: dict[str, Any]) -> dict[str, Any]:
    """``actor_options`` (Ray actor options) with the head node's resource added."""
    return {**actor_options, "resources": {**actor_options.get("resources", {}), HEAD_NODE_RESOURCE: HEAD_SLIVER}}

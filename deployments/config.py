"""Typed arguments of the Serve application (pydantic: this is the edge of the system).

``AppArgs`` is what ``serve run configs/*.yaml`` passes to ``deployments.app:build_app``
under ``args:``. Every deployment receives the validated model as a plain dict and
re-validates it, so the same object governs the replica, the controller and the API.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from treespark.pricing.costmodel import AcceptanceProfile, CostModel
from treespark.pricing.policy import (
    BudgetPolicy,
    CostModelPolicy,
    FixedPolicy,
    LadderPolicy,
    PerStepPolicy,
)
from treespark.spec.budget import DEFAULT_BRANCH_CAP, Budget

ROOT = Path(__file__).resolve().parents[1]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BudgetArgs(_Strict):
    """A ``Budget``'s wire form (``Budget.to_wire``) validated at the edge, configs and
    request bodies alike: strict types (``false`` is not a node cap, ``"0.1"`` not a theta)."""

    theta: float = Field(ge=0.0, strict=True)
    node_cap: int = Field(ge=0, strict=True)
    branch_cap: int = Field(ge=1, strict=True)

    def to_budget(self) -> Budget:
        return Budget.from_wire(self.model_dump())

    @classmethod
    def of(cls, b: Budget) -> BudgetArgs:
        return cls.model_validate(b.to_wire())


def _default_ladder_budgets() -> list[BudgetArgs]:
    return [BudgetArgs.of(r.budget) for r in LadderPolicy().rungs]


class PolicyArgs(_Strict):
    """``perstep``: every engine allocates every step's draft nodes on its own step-cost
    table, measured at startup in at most ``profile_s`` seconds (or read from the cache
    when ``cost_cache``) and, with ``online_costs``, corrected from the steps it measures
    in service (``treespark.pricing.costfit``), under a price theta the controller raises when the cluster
    queues (``treespark.pricing.policy.PerStepPolicy``); ``max_nodes`` / ``max_branch``
    bound what is drafted. ``ladder``: ``budgets[i]`` while load per replica <= ``thresholds[i]``, the last
    budget beyond; ``fixed``: always ``budget`` (baselines); ``costmodel``: theta priced
    from a measured ``treespark cost-model`` JSON (``cost_model``: a path, relative paths
    from the repository root, or the JSON object itself) and the acceptance per tree size
    (a saturating prior ``prior_ceiling * (1 - exp(-n / prior_scale))`` refined online)."""

    kind: Literal["perstep", "ladder", "fixed", "costmodel"] = "perstep"   # what every shipped config runs
    thresholds: list[float] = Field(default_factory=lambda: [r.max_load for r in LadderPolicy().rungs[:-1]])
    budgets: list[BudgetArgs] = Field(default_factory=_default_ladder_budgets)
    budget: BudgetArgs | None = None
    cost_model: str | dict[str, Any] | None = None
    max_nodes: int = Field(32, ge=0)
    max_branch: int = Field(DEFAULT_BRANCH_CAP, ge=1)
    queue_weight: float = Field(1.0, ge=0)
    prior_ceiling: float = Field(1.3, ge=0)
    prior_scale: float = Field(5.0, gt=0)
    prior_weight: float = Field(200.0, ge=0)
    min_gain: float = Field(1.0, ge=0)
    draft_node_s: float = Field(0.0, ge=0)  # drafting s/node until learned online
    trend_weight: float = Field(1.0, ge=0)   # perstep: pressure per request/s of queue growth
    max_theta: float = Field(0.95, ge=0, le=1)
    profile_s: float = Field(20.0, gt=0)     # perstep: the startup measurement's time budget
    cost_cache: bool = True                  # perstep: reuse a table cached for this hardware + model
    online_costs: bool = False               # perstep: correct the table from the steps measured in service

    @model_validator(mode="after")
    def _check(self) -> PolicyArgs:
        self.build()  # raises ValueError (-> ValidationError) on a non-monotone ladder
        return self

    def load_cost_model(self) -> CostModel:
        if self.cost_model is None:
            raise ValueError("policy kind 'costmodel' needs 'cost_model' (a `treespark cost-model` JSON)")
        if isinstance(self.cost_model, dict):
            return CostModel.from_json(self.cost_model)
        path = Path(self.cost_model)
        if not path.is_absolute() and not path.exists():
            path = ROOT / path
        return CostModel.from_json(json.loads(path.read_text()))

    def build(self, max_batch: int | None = None) -> BudgetPolicy:
        """The policy; ``max_batch`` (the engine's batch rows) lets the cost-model policy
        tell requests about to join the batch from requests waiting for capacity."""
        if self.kind == "costmodel":
            prior = AcceptanceProfile.saturating(self.prior_ceiling, self.prior_scale, max(self.max_nodes, 1))
            return CostModelPolicy(self.load_cost_model(), prior, max_nodes=self.max_nodes,
                                   max_branch=self.max_branch, queue_weight=self.queue_weight,
                                   prior_weight=self.prior_weight, min_gain=self.min_gain,
                                   draft_node_s=self.draft_node_s,
                                   max_batch=max_batch)
        if self.kind == "perstep":
            return PerStepPolicy(max_nodes=self.max_nodes, max_branch=self.max_branch, max_batch=max_batch,
                                 queue_weight=self.queue_weight, trend_weight=self.trend_weight,
                                 max_theta=self.max_theta)
        if self.kind == "fixed":
            if self.budget is None:
                raise ValueError("policy kind 'fixed' needs 'budget'")
            return FixedPolicy(self.budget.to_budget())
        return LadderPolicy.from_thresholds(self.thresholds, [b.to_budget() for b in self.budgets])


class AutoscalingArgs(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)   # Serve averages ongoing requests over this window

    @model_validator(mode="after")
    def _check(self) -> AutoscalingArgs:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling max_replicas must be >= min_replicas")
        return self


class ReplicaArgs(_Strict):
    """Ray resources and Serve options of the engine replica deployment."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # custom Ray resources per replica: replicas run only on nodes that have them
    # (``deployments.placement``), e.g. {"treespark_worker": 1}
    resources: dict[str, float] = Field(default_factory=dict)
    num_replicas: int | None = Field(None, ge=1)
    autoscaling: AutoscalingArgs | None = None
    max_ongoing_requests: int | None = Field(None, ge=1)  # per replica; default 2 * max_batch_size
    max_queued_requests: int = Field(64, ge=-1)  # per caller (API replica); beyond it: backpressure_status
    backpressure_status: Literal[503, 429] = 503
    retry_after_s: float = Field(1.0, ge=0)  # the Retry-After of a backpressure answer
    torch_threads: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> ReplicaArgs:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("set either replica.num_replicas or replica.autoscaling, not both")
        return self


class LimitArgs(_Strict):
    """What one request may ask for; the API answers 4xx beyond these (413 for the body),
    before the request reaches an engine replica."""

    max_body_bytes: int = Field(1 << 20, ge=256)
    max_prompt_chars: int = Field(65536, ge=1)  # a text prompt, or all chat message texts together
    max_messages: int = Field(256, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # cap on max_tokens (always also < max_context)
    max_stop: int = Field(4, ge=0)  # stop strings per request
    max_stop_chars: int = Field(128, ge=1)  # characters per stop string
    max_stop_token_ids: int = Field(16, ge=0)
    max_n: int = Field(8, ge=1)  # choices per request (each one engine request)
    queue_timeout_s: float = Field(60.0, gt=0)  # no replica took the request by then: 503
    # re-issues of one engine request whose replica died or drained, before or mid-stream
    # (deployments.http.resume). Each continues the generation on another replica, and a
    # request that kills its replicas must not take the fleet down one by one: 2 covers a lost
    # node plus its replacement's own failure.
    replica_retries: int = Field(2, ge=0)


class ControllerArgs(_Strict):
    name: str = "treespark-controller"
    namespace: str = "treespark"
    heartbeat_s: float = Field(0.25, gt=0, le=0.5)  # replicas report (and pull their budget) this often
    heartbeat_timeout_s: float = Field(2.0, gt=0)  # a replica silent this long is dropped
    rpc_timeout_s: float = Field(1.0, gt=0)
    pricing: bool = True  # False: the controller only observes; each replica prices itself (local policy)
    online_calibration: bool = True  # refit (a, b) from the replicas' pooled records and push it
    min_calibration_records: int = Field(2000, ge=10)
    calibration_prior_records: int = Field(2000, ge=0)  # online fit shrunk toward the stored one


class AppArgs(_Strict):
    """Arguments of ``build_app``. ``model``: ``default`` (the embedded SmolLM2 pair),
    ``random`` (a tiny random pair, no tokenizer: byte-level text), or a target model id
    with ``drafter`` a drafter checkpoint id."""

    model: str = "default"
    drafter: str | None = None
    served_model_name: str | None = None
    vocab_size: int = Field(512, ge=2)  # model: random only
    seed: int = 0
    # the target's weights: float32 as loaded, or rounded to bfloat16 values (computed in
    # float32; on CPU the product kernel then reads half the bytes; treespark.models.precision)
    precision: Literal["float32", "bfloat16"] = "float32"
    max_batch_size: int = Field(8, ge=1)
    max_context: int = Field(1024, ge=2)
    # tokens a step: the running rows' trees, then prompt chunks up to this
    # (EngineConfig.max_num_batched_tokens). A pair whose prefill is compute-bound (the
    # default pair on a CPU) does better at 256 in time to first token and inter-token
    # latency both; a small model's steps, whose fixed cost dominates, at 512
    # (docs/benchmarks/serving.md)
    max_num_batched_tokens: int = Field(512, ge=1)
    # KV memory: the fraction of device memory (less what is in use once the weights are
    # loaded) the KV rows may take; an engine runs fewer than max_batch_size requests if
    # that is what it holds (0: max_batch_size rows, no check)
    kv_memory_fraction: float = Field(0.0, ge=0.0, le=1.0)
    # draft nodes per tree the engines hold at most, whatever the budget (EngineConfig.max_tree_nodes);
    # also the largest node_cap ``POST /v1/speculation/override`` accepts
    max_tree_nodes: int = Field(64, ge=0)
    # reuse the KV blocks of a prompt's longest cached prefix (EngineConfig.prefix_caching);
    # off: every prompt token is computed (what the prefix-cache load test compares against)
    prefix_caching: bool = True
    # torch.compile's backend for the target forward's norms, rotation and activation
    # (EngineConfig.compile_backend), e.g. "inductor": for GPUs, where the eager forward is
    # launch-bound; compiling takes tens of seconds at startup. None: eager
    compile_backend: str | None = None
    # the verify forward replayed from CUDA graphs, padded to buckets (powers of two)
    # (EngineConfig.cuda_graphs): for GPUs; each bucket is captured on its first step. Off
    # CUDA nothing is captured and the padded forward runs eagerly, with one warning
    cuda_graphs: bool = False
    # the drafter's block pass too (EngineConfig.cuda_graphs_draft; needs cuda_graphs)
    cuda_graphs_draft: bool = False
    default_max_tokens: int = Field(256, ge=1)  # chat requests without max_tokens
    device: str | None = None
    engine_factory: str = "deployments.replica.engine_factory:build_engine"  # "module:callable(AppArgs) -> EngineBundle", run on the engine thread
    policy: PolicyArgs = Field(default_factory=PolicyArgs)
    replica: ReplicaArgs = Field(default_factory=ReplicaArgs)
    controller: ControllerArgs = Field(default_factory=ControllerArgs)
    limits: LimitArgs = Field(default_factory=LimitArgs)
    # The *name* of an environment variable holding the API key (never the key itself, which
    # would travel in the Serve config). Set: every route but /health needs
    # ``Authorization: Bearer <key>``, and the API refuses to start if the variable is empty.
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @model_validator(mode="after")
    def _caps_fit_the_engines(self) -> AppArgs:
        """A budget the engines would clip is a configuration error, not a silent change."""
        p, cap = self.policy, self.max_tree_nodes
        named = {"costmodel": [("policy.max_nodes", p.max_nodes)], "perstep": [("policy.max_nodes", p.max_nodes)],
                 "fixed": [("policy.budget.node_cap", p.budget.node_cap if p.budget else 0)],
                 "ladder": [(f"policy.budgets[{i}].node_cap", b.node_cap) for i, b in enumerate(p.budgets)]}
        for name, n in named[p.kind]:
            if n > cap:
                raise ValueError(f"{name} is {n} but max_tree_nodes is {cap}: the engines would clip "
                                 f"every tree to {cap} nodes; raise max_tree_nodes or lower {name}")
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return {"default": "treespark-smollm2", "random": "treespark-random"}.get(self.model, self.model)

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def import_attr(path: str) -> Any:
    """``'pkg.module:attr'`` -> the attribute."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"expected 'module:attribute', got {path!r}")
    return getattr(importlib.import_module(module), attr)

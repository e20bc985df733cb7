"""How a replica gets its engine: ``EngineBundle`` and the default ``build_engine``.

``AppArgs.engine_factory`` names a callable ``(AppArgs) -> EngineBundle``; the default
builds the real ``treespark`` engine on the configured model pair (tests name a fake
engine instead, to isolate the deployments from the model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deployments.config import AppArgs
from deployments.replica.text import ByteTokenizer


@dataclass(frozen=True)
class EngineBundle:
    """What an ``engine_factory`` returns: the engine, a tokenizer (HF or ``ByteTokenizer``),
    the ``SamplingParams`` constructor, and the token ids that end a generation."""

    engine: Any
    tokenizer: Any
    make_params: Callable[..., Any]
    eos_token_ids: tuple[int, ...] = ()
    step_costs: dict[str, Any] | None = None   # perstep: the startup table's summary (reported to the controller)


def build_engine(args: AppArgs) -> EngineBundle:
    """The default ``engine_factory``: the real engine on the configured model pair
    (the pair decides the device)."""
    from treespark.engine.config import EngineConfig
    from treespark.engine.core import Engine
    from treespark.models.pair import pair_by_name
    from treespark.spec.params import SamplingParams

    pair = pair_by_name(args.model, args.drafter, device=args.device, vocab_size=args.vocab_size,
                        seed=args.seed, precision=args.precision, progress=False)
    engine = Engine(pair, EngineConfig(max_batch_size=args.max_batch_size, max_context=args.max_context,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        max_tree_nodes=args.max_tree_nodes,
                                        kv_memory_fraction=args.kv_memory_fraction,
                                        prefix_caching=args.prefix_caching, compile_backend=args.compile_backend,
                                        cuda_graphs=args.cuda_graphs, cuda_graphs_draft=args.cuda_graphs_draft))
    tok = pair.tokenizer if pair.tokenizer is not None else ByteTokenizer(engine.vocab_size)
    step_costs = None
    if args.policy.kind == "perstep":
        step_costs = install_allocator(engine, args)
    return EngineBundle(engine=engine, tokenizer=tok, make_params=SamplingParams,
                        eos_token_ids=pair.stop_token_ids, step_costs=step_costs)


def install_allocator(engine: Any, args: AppArgs) -> dict[str, Any]:
    """The per-step allocation on ``engine``, priced on the replica's own step-cost table
    (measured now, before any traffic, or read from the cache); returns its summary."""
    from treespark.engine.step_alloc import StepAllocator
    from treespark.engine.step_costs import CACHE_DIR, startup_step_costs
    from treespark.pricing.costfit import CostFit

    table = startup_step_costs(engine, time_budget_s=args.policy.profile_s,
                               cache_dir=CACHE_DIR if args.policy.cost_cache else None)
    fit = CostFit() if args.policy.online_costs else None
    engine.set_allocator(StepAllocator(table.step_costs(args.max_tree_nodes), fit=fit))
    v, d = table.verify, table.draft
    return {"fingerprint": table.fingerprint, "source": table.source, "measured_s": table.measured_s,
            "device": v.device, "threads": v.threads,
            "products": engine.runner.products_described, "verify_1x1_s": v.time(1, 1),
            "verify_max_batch_x1_s": v.time(v.batch_sizes[-1], 1),
            "draft_1x1_s": d.time(1, 1) if d else 0.0,     # one row drafting at a cap of 1, and of the engine's most
            "draft_1xmax_s": d.time(1, args.max_tree_nodes) if d else 0.0, "max_tree_nodes": args.max_tree_nodes,
            "host_node_s": table.host_node_s, "table": table.to_json()}

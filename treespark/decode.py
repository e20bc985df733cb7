"""``generate``: one request through the engine (there is one decode loop)."""

from __future__ import annotations

from dataclasses import dataclass

from treespark.budget import Budget
from treespark.engine import Engine, EngineConfig
from treespark.models import ModelPair
from treespark.params import RequestStats, RoundStats, SamplingParams


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]              # the new tokens only
    rounds: list[RoundStats]          # one per target forward after prefill
    finish_reason: str
    stats: RequestStats

    @property
    def tokens_per_round(self) -> float:
        return self.stats.tokens_per_round


def generate(
    pair: ModelPair,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    budget: Budget | None = None,
    top_p: float = 1.0,
    stop_token_ids: tuple[int, ...] = (),
) -> Generation:
    """Decode ``max_new_tokens`` after ``prompt_ids`` with speculative draft trees.

    ``budget=None`` is the default adaptive tree; ``Budget.chain(k)`` a chain and
    ``Budget.off()`` plain decoding. The output has exactly the target's distribution
    (greedy: the target's tokens). Raises ValueError on bad input.
    """
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids, seed=seed)
    if budget is not None and not isinstance(budget, Budget):
        raise ValueError(f"budget must be a treespark.Budget or None, got {type(budget).__name__}")
    n = len(prompt_ids) if hasattr(prompt_ids, "__len__") else 0
    engine = Engine(pair, EngineConfig(max_batch_size=1, max_context=max(n, 1) + max_new_tokens,
                                       prefill_chunk=max(n, 1)),
                    budget=budget or Budget.adaptive())
    engine.add_request("generate", prompt_ids, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                assert out.stats is not None and out.finish_reason is not None
                return Generation(tokens, list(out.stats.round_stats), out.finish_reason, out.stats)
    raise RuntimeError("the engine stopped without finishing the request")

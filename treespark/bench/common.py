"""What the benchmarks share: pairs by name, prompt sets, engine runs, tables."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treespark.budget import Budget
from treespark.engine import Engine, EngineConfig
from treespark.models import ModelPair, load_pair, random_pair
from treespark.params import SamplingParams, StepStats
from treespark.pricing.policy import LoadSnapshot, PerStepPolicy
from treespark.step_alloc import StepAllocator
from treespark.step_costs import StepCostTable


def pair_by_name(name: str, drafter: str | None = None) -> ModelPair:
    """``default`` (with ``drafter``: that drafter directory instead of the shipped one) or
    ``random``."""
    if name == "default":
        return load_pair(drafter=drafter)
    if drafter is not None:
        raise ValueError("--drafter goes with the default pair")
    if name == "random":
        return random_pair(512, 0, block_size=4)
    raise ValueError(f"unknown pair {name!r}: use 'default' or 'random'")


def bench_prompts(pair: ModelPair, n: int, split: str = "heldout", seed: int = 0) -> list[list[int]]:
    """Chat-templated prompts of ``split`` for a real pair ("heldout" for evaluation,
    "tune" for calibration and defaults, "train"); random token prompts otherwise."""
    if pair.tokenizer is not None:
        from treespark.chat import chat_ids
        from treespark.prompts import load_prompts, tuning_prompts

        texts = [p.text for p in (tuning_prompts() if split == "tune" else load_prompts(split))]
        return [chat_ids(pair.tokenizer, texts[i % len(texts)]) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, pair.vocab_size, (24,), generator=g).tolist() for _ in range(n)]


@dataclass(frozen=True)
class RunResult:
    tokens: int
    wall_s: float
    steps: int
    rounds: int
    accepted: int
    drafted: int
    step_stats: tuple[StepStats, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward, per request (accepted + 1 per round)."""
        return (self.accepted + self.rounds) / max(self.rounds, 1)


def run_engine(pair: ModelPair, prompts: list[list[int]], budget: Budget, *, max_tokens: int,
               batch_size: int, temperature: float = 0.0, seed: int = 0,
               allocator: StepAllocator | None = None) -> RunResult:
    """Serve every prompt through one engine (batch_size rows) and time it; with
    ``allocator``, every step priced by it (the served per-step policy)."""
    longest = max(len(p) for p in prompts)
    engine = Engine(pair, EngineConfig(max_batch_size=batch_size, max_context=longest + max_tokens),
                    budget=budget)
    engine.set_allocator(allocator)
    stats: list[StepStats] = []
    engine.on_step = stats.append
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed + i,
            stop_token_ids=pair.stop_token_ids))
    tokens = rounds = accepted = drafted = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished and out.stats is not None:
                rounds += out.stats.rounds
                accepted += out.stats.accepted_tokens
                drafted += out.stats.drafted_tokens
        steps += 1
    return RunResult(tokens, time.perf_counter() - t0, steps, rounds, accepted, drafted, tuple(stats))


def served_budget() -> Budget:
    """The served default's drafting budget with no queue: ``PerStepPolicy``'s at floor 0,
    which the per-step allocation then cuts every step."""
    return PerStepPolicy().budget_for(LoadSnapshot(replicas=1, active=0, queued=0))


def served_table(pair: ModelPair, *, max_batch: int, max_context: int, profile_s: float,
                 cache_dir: Path | None) -> StepCostTable:
    """The step-cost table a replica of ``max_batch`` rows starts with (measured in at most
    ``profile_s`` seconds, or read from ``cache_dir``; None: always measured)."""
    from treespark.step_costs import startup_step_costs

    engine = Engine(pair, EngineConfig(max_batch_size=max_batch, max_context=max(max_context, 1024)))
    return startup_step_costs(engine, time_budget_s=profile_s, cache_dir=cache_dir)


def served_allocator(table: StepCostTable) -> StepAllocator:
    """A fresh per-step allocation on ``table``, as a served replica installs it."""
    return StepAllocator(table.step_costs(served_budget().node_cap))


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)

"""What the benchmarks share: the served default's budget, table and allocation; tables."""

from __future__ import annotations

import sys
from pathlib import Path

from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.step_alloc import StepAllocator
from treespark.engine.step_costs import StepCostTable
from treespark.models.pair import ModelPair
from treespark.pricing.policy import LoadSnapshot, PerStepPolicy
from treespark.spec.budget import Budget


def served_budget() -> Budget:
    """The served default's drafting budget with no queue: ``PerStepPolicy``'s at theta 0,
    which the per-step allocation then cuts every step."""
    return PerStepPolicy().budget_for(LoadSnapshot(replicas=1, active=0, queued=0))


def served_table(pair: ModelPair, *, max_batch: int, max_context: int, profile_s: float,
                 cache_dir: Path | None) -> StepCostTable:
    """The step-cost table a replica of ``max_batch`` rows starts with (measured in at most
    ``profile_s`` seconds, or read from ``cache_dir``; None: always measured)."""
    from treespark.engine.step_costs import startup_step_costs

    engine = Engine(pair, EngineConfig(max_batch_size=max_batch, max_context=max(max_context, 1024)))
    return startup_step_costs(engine, time_budget_s=profile_s, cache_dir=cache_dir)


def served_allocator(table: StepCostTable) -> StepAllocator:
    """A fresh per-step allocation on ``table``, as a served replica installs it."""
    return StepAllocator(table.step_costs(served_budget().node_cap))


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_out(text: str, out: str | None) -> None:
    """Print ``text``; also write it to ``out`` (its folder made) when given."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"written to {out}", file=sys.stderr)

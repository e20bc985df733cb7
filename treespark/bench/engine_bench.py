"""Engine throughput: tokens/s at several batch sizes, plain decoding against fixed chains
and trees, the adaptive tree, and the served per-step allocation, side by side."""

from __future__ import annotations

import statistics
from pathlib import Path

from treespark.bench.common import markdown_table, served_allocator, served_budget, served_table
from treespark.engine.run import RunResult, run_engine
from treespark.engine.step_alloc import StepAllocator
from treespark.models.pair import ModelPair
from treespark.models.prompts import pair_prompts
from treespark.spec.budget import Budget

PER_STEP = "per-step"


def fixed_budgets(chains=(2, 4)) -> dict[str, Budget]:
    """The fixed decoders the per-step allocation is measured against."""
    return {"plain": Budget.off(), **{f"chain-{k}": Budget.chain(k) for k in chains},
            "tree-8": Budget(0.0, 8, 2), "adaptive": Budget.adaptive()}


def engine_benchmark(pair: ModelPair, *, batch_sizes=(1, 4, 8, 16), max_tokens: int = 64,
                     chains=(2, 4), per_step: bool = True, batches: int = 1, repeats: int = 1,
                     temperature: float = 0.0, cost_cache: Path | None = None, profile_s: float = 20.0,
                     log=print) -> str:
    """One cell per (batch size, decoder): ``batches * bs`` held-out prompts through an
    engine of ``bs`` rows; ``repeats`` passes over the decoders (in reversed order every
    other pass, so a drifting machine does not favour one), the median reported. With
    ``per_step``, the served default too: ``served_budget()`` with the per-step allocation on the
    step-cost table measured at startup (``treespark.engine.step_costs``, cached), and its ratio
    to the best fixed decoder of the row (``cost_cache``: the table cache's folder, None:
    ``treespark.engine.step_costs.CACHE_DIR``)."""
    configs = fixed_budgets(chains)
    table = None
    if per_step:
        from treespark.engine.step_costs import CACHE_DIR

        longest = max(len(p) for p in pair_prompts(pair, max(batch_sizes) * batches))
        table = served_table(pair, max_batch=max(batch_sizes), max_context=longest + max_tokens,
                             profile_s=profile_s, cache_dir=cost_cache or CACHE_DIR)
        log(f"step-cost table: {table.source} ({table.measured_s:.1f} s)")
        configs[PER_STEP] = served_budget()

    def allocator(name: str) -> StepAllocator | None:
        return served_allocator(table) if name == PER_STEP else None

    for name, budget in configs.items():  # warm-up: the first forwards of a process are slow
        run_engine(pair, pair_prompts(pair, 1), budget, max_tokens=8, batch_size=1, temperature=temperature,
                   allocator=allocator(name))
    rows = []
    for bs in batch_sizes:
        prompts = pair_prompts(pair, bs * batches)
        runs: dict[str, list[RunResult]] = {name: [] for name in configs}
        for rep in range(repeats):
            for name in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
                r = run_engine(pair, prompts, configs[name], max_tokens=max_tokens, batch_size=bs,
                               temperature=temperature, allocator=allocator(name))
                runs[name].append(r)
                log(f"bs={bs:>2} {name:>9}: {r.tokens_per_s:7.1f} tok/s  tau {r.tau:.2f}  "
                    f"({r.tokens} tokens in {r.wall_s:.1f} s)")
        rate = {name: statistics.median(r.tokens_per_s for r in rs) for name, rs in runs.items()}
        base = rate["plain"]
        row = [str(bs)] + [f"{rate[n]:.1f} ({rate[n] / base:.2f}x, tau {rs[0].tau:.2f})" for n, rs in runs.items()]
        if per_step:
            best = max((n for n in configs if n != PER_STEP), key=rate.__getitem__)
            row.append(f"{rate[PER_STEP] / rate[best]:.2f} ({best})")
        rows.append(row)
    header = ["batch"] + list(configs) + (["per-step / best fixed"] if per_step else [])
    note = (f"\n\n{batches} batch(es) of held-out prompts per cell, {max_tokens} tokens each, T = {temperature:g}; "
            f"tokens/s (ratio to plain, tau); the median of {repeats} pass(es)."
            + (f" per-step: budget (theta {configs[PER_STEP].theta:g}, {configs[PER_STEP].node_cap} nodes, "
               f"{configs[PER_STEP].branch_cap} wide) cut every step by the per-step allocation on the startup "
               "step-cost table, as served with no queue." if per_step else ""))
    return markdown_table(header, rows) + note

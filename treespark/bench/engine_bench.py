"""Engine throughput: tokens/s at several batch sizes, plain vs chain vs adaptive tree."""

from __future__ import annotations

from treespark.bench.common import bench_prompts, markdown_table, run_engine
from treespark.budget import Budget
from treespark.models import ModelPair


def engine_benchmark(pair: ModelPair, *, batch_sizes=(1, 4, 8, 16), max_tokens: int = 64,
                     chain: int = 4, temperature: float = 0.0, log=print) -> str:
    configs = {"plain": Budget.off(), f"chain-{chain}": Budget.chain(chain), "adaptive": Budget.adaptive()}
    rows = []
    for budget in configs.values():  # warm-up: the first forwards of a process are slow
        run_engine(pair, bench_prompts(pair, 1), budget, max_tokens=8, batch_size=1, temperature=temperature)
    for bs in batch_sizes:
        prompts = bench_prompts(pair, bs)
        results = {}
        for name, budget in configs.items():
            r = run_engine(pair, prompts, budget, max_tokens=max_tokens, batch_size=bs,
                           temperature=temperature)
            results[name] = r
            log(f"bs={bs:>2} {name:>9}: {r.tokens_per_s:7.1f} tok/s  tau {r.tau:.2f}  "
                f"({r.tokens} tokens in {r.wall_s:.1f} s)")
        base = results["plain"].tokens_per_s
        rows.append([str(bs)] + [f"{r.tokens_per_s:.1f} ({r.tokens_per_s / base:.2f}x, tau {r.tau:.2f})"
                                  for r in results.values()])
    return markdown_table(["batch"] + list(configs), rows)

"""What one round costs at a large vocabulary: plain, a chain and a tree, side by side.

A tiny random target (``family``, hidden 64) with a DSpark-shaped drafter of the public
Qwen3-4B pair's size (vocabulary 151,936, Markov rank 256, block 7) decodes one request
at batch 1; each policy's decode steps are timed and split into drafting (the backbone
pass and the depth waves) and verification (the target forward, the walk on the
device, the commit). The target is tiny, so the table isolates what the method adds
per round on top of a forward, which is what grows with the vocabulary. Host syncs and
the numbers copied to the host per step come from the engine's own counts.
"""

from __future__ import annotations

import statistics
import time

from treespark.bench.common import markdown_table
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.models.pair import random_pair
from treespark.spec.budget import Budget
from treespark.spec.params import SamplingParams, StepStats

POLICIES = {"plain": Budget.off(), "chain of 4": Budget.chain(4), "tree of 32": Budget(0.0, 32, 4)}


def _steps(pair, budget: Budget, temperature: float, new_tokens: int, seed: int) -> list[StepStats]:
    engine = Engine(pair, EngineConfig(max_batch_size=1, max_context=64 + new_tokens), budget=budget)
    stats: list[StepStats] = []
    engine.on_step = stats.append
    engine.add_request("r", list(range(1, 25)), SamplingParams(temperature=temperature, max_tokens=new_tokens,
                                                                seed=seed))
    while engine.has_unfinished():
        engine.step()
    return stats


def rounds_benchmark(*, vocab_size: int = 151_936, markov_rank: int = 256, block_size: int = 7,
                     family: str = "qwen3", draft_vocab: int = 0, new_tokens: int = 32,
                     temperatures=(0.0, 1.0), repeats: int = 3, seed: int = 0, log=print) -> str:
    t0 = time.perf_counter()
    pair = random_pair(vocab_size, seed, block_size, markov_rank=markov_rank, family=family,
                       draft_vocab=draft_vocab)
    log(f"pair built in {time.perf_counter() - t0:.1f} s: V={vocab_size}, draft vocab "
        f"{draft_vocab or vocab_size}, rank {markov_rank}, block {block_size}, {family}")
    rows = []
    for t in temperatures:
        base = None
        for name, budget in POLICIES.items():
            _steps(pair, budget, t, 4, seed)  # warm-up
            runs = [_steps(pair, budget, t, new_tokens, seed + r) for r in range(repeats)]
            # every step after the first (which holds no prefill here) is one round
            flat = [s for run in runs for s in run]
            med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
            round_ms = med([s.step_s for s in flat])
            base = base or round_ms
            rows.append([f"{t:g}", name, f"{round_ms:.1f}", f"{round_ms / base:.1f}x",
                         f"{med([s.draft_s for s in flat]):.1f}", f"{med([s.verify_s for s in flat]):.1f}",
                         f"{statistics.mean(s.draft_waves for s in flat):.1f}",
                         f"{statistics.mean(s.tree_sizes[0] for s in flat):.1f}",
                         f"{max(s.host_syncs for s in flat)}", f"{max(s.host_elements for s in flat)}"])
            log(" | ".join(rows[-1]))
    return markdown_table(["T", "round", "ms per round (median)", "vs plain", "drafting ms", "verify ms",
                           "waves", "tree nodes", "host syncs (max)", "host numbers (max)"], rows)

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


HOST_BUDGET = Budget(0.0, 32, 4)  # trees of 32 nodes, 4 children a node


def batch_steps(pair, batch: int, temperature: float, steps: int, *, budget: Budget = HOST_BUDGET,
                engine=Engine, seed: int = 0, cpu_s: list[float] | None = None) -> list[StepStats]:
    """``steps`` decode steps of ``batch`` requests drafting under ``budget``, after one
    warm-up step. The batch is filled with plain decoding (each request's prefill, one
    per step), so that only the steps reported draft trees. ``cpu_s``: gets each
    reported step's CPU seconds (this process)."""
    new = batch + 8 * (steps + 2)  # plain tokens while the batch fills, then <= 8 a round
    eng = engine(pair, EngineConfig(max_batch_size=batch, max_context=8 + new), budget=Budget.off())
    for i in range(batch):
        eng.add_request(f"r{i}", [(7 * i + j) % pair.vocab_size for j in range(1, 9)],
                        SamplingParams(temperature=temperature, max_tokens=new, seed=seed + i))
    while eng.num_waiting:
        eng.step()
    eng.set_budget(budget)
    stats: list[StepStats] = []
    eng.on_step = stats.append
    for i in range(steps + 1):
        c0 = time.process_time()
        eng.step()
        if cpu_s is not None and i > 0:
            cpu_s.append(time.process_time() - c0)
    return stats[1:]


def host_benchmark(*, vocab_size: int = 151_936, markov_rank: int = 256, block_size: int = 7,
                   family: str = "qwen3", draft_vocab: int = 0, batch_sizes=(1, 32),
                   temperatures=(0.0, 1.0), steps: int = 3, seed: int = 0, log=print) -> str:
    """Whole decode steps of a batch drafting trees of 32 (``HOST_BUDGET``) on the random
    pair at a GPU pair's vocabulary: CPU ms per step (the work, which the machine's load
    hardly moves; on CPU every step's work is host work), wall ms, the stages, and the
    step's copies: host syncs (device to host) and uploads (host to device)."""
    pair = random_pair(vocab_size, seed, block_size, markov_rank=markov_rank, family=family,
                       draft_vocab=draft_vocab)
    rows = []
    for b in batch_sizes:
        for t in temperatures:
            cpu: list[float] = []
            cells = list(zip(batch_steps(pair, b, t, steps, cpu_s=cpu), cpu, strict=True))
            med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
            stats = [s for s, _ in cells]
            rows.append([str(b), f"{t:g}", f"{med([c for _, c in cells]):.0f}", f"{med([s.step_s for s in stats]):.0f}",
                         f"{med([s.draft_s for s in stats]):.0f}", f"{med([s.verify_s for s in stats]):.0f}",
                         f"{statistics.mean(s.draft_waves for s in stats):.1f}",
                         f"{statistics.mean(sum(s.tree_sizes) for s in stats):.0f}",
                         f"{max(s.host_syncs for s in stats)}", f"{max(s.host_uploads for s in stats)}"])
            log(" | ".join(rows[-1]))
    return markdown_table(["batch", "T", "CPU ms per step (median)", "wall ms", "drafting ms", "verify ms", "waves",
                           "nodes in the step", "host syncs (max)", "uploads (max)"], rows)


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

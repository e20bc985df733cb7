"""The T > 0 walk eager and compiled, side by side: milliseconds per decode step.

The tiny random Qwen3 pair at the GPU pair's vocabulary (151,936; Markov rank 256,
block 7) decodes a full batch at T = 1 with trees of 32 (``host_steps.host_budget``); every
step's call of ``walk_sampled`` is recorded (its inputs), then replayed with each depth
eager (``walk_level``) and compiled (``compiled(walk_level, backend)``, what
``EngineConfig.compile_backend`` runs): each call once untimed (compiling the graphs
its shapes need), then timed. The outputs (accepted paths and last tokens) are compared
call for call."""

from __future__ import annotations

import statistics
import time

import torch

import treespark.engine.accept as accept_module
from treespark.bench.common import markdown_table
from treespark.bench.host_steps import host_budget
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.kernels.compile import compiled
from treespark.models.pair import random_pair
from treespark.spec.params import SamplingParams
from treespark.spec.walk import walk_level, walk_sampled


def recorded_walks(pair, batch: int, steps: int) -> list[tuple]:
    """The inputs of ``walk_sampled`` in ``steps`` decode steps of a full batch at T = 1."""
    calls: list[tuple] = []

    def record(*args):
        calls.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return walk_sampled(*args)

    engine = Engine(pair, EngineConfig(max_batch_size=batch, max_context=512, max_tree_nodes=32), budget=host_budget())
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(1, pair.vocab_size - 1, (8,), generator=g).tolist(),
                           SamplingParams(temperature=1.0, max_tokens=400, seed=i))
    while engine.num_waiting:
        engine.step()
    accept_module.walk_sampled = record
    try:
        for _ in range(steps):
            engine.step()
    finally:
        accept_module.walk_sampled = walk_sampled
    return calls


def _replay(calls: list[tuple], level) -> tuple[list[float], list[torch.Tensor]]:
    times, outs = [], []
    for args in calls:
        walk_sampled(*args[:10], level)             # compiles what this call's shapes need
        t = time.perf_counter()
        outs.append(walk_sampled(*args[:10], level))
        times.append(time.perf_counter() - t)
    return times, outs


def walk_benchmark(batch_sizes=(1, 8, 32), backend: str = "inductor", steps: int = 5,
                   vocab_size: int = 151_936, seed: int = 0, log=print) -> str:
    pair = random_pair(vocab_size, seed, 7, markov_rank=256, family="qwen3")
    fast = compiled(walk_level, backend)
    rows = []
    for b in batch_sizes:
        calls = recorded_walks(pair, b, steps)
        eager_t, eager_out = _replay(calls, walk_level)
        fast_t, fast_out = _replay(calls, fast)
        e, f = statistics.median(eager_t) * 1e3, statistics.median(fast_t) * 1e3
        same = sum(torch.equal(x, y) for x, y in zip(eager_out, fast_out, strict=True))
        depth = statistics.mean(c[4].depth for c in calls)
        rows.append([str(b), f"{depth:.1f}", f"{e:.1f}", f"{f:.1f}", f"{f / e:.2f}x", f"{same}/{len(calls)}"])
        log(" | ".join(rows[-1]))
    return (f"{torch.get_num_threads()} threads; the walks of {steps} decode steps, each replayed once untimed, "
            "then timed; medians.\n\n"
            + markdown_table(["batch", "tree depth (mean)", "walk ms, eager", f"{backend}", f"{backend} / eager",
                              "calls with the same output"], rows) + "\n")

"""``treespark bench rounds --host``: how much of a whole decode step is host work, at a
batch of trees of 32 on the random pair at a GPU pair's vocabulary.

A tiny random target (``family``, hidden 64) with a DSpark-shaped drafter of the public
Qwen3-4B pair's size (vocabulary 151,936, Markov rank 256, block 7); ``batch`` requests
(8-token prompts) fill the batch under plain decoding, then decode steps draft trees of
32 nodes, 4 children a node (``HOST_BUDGET``). Per step, the medians of ``steps``:

* CPU ms (this process) and wall ms: on a CPU every step's work is host work, the
  vocabulary-sized products (the Markov head scoring ~1,000 parents at batch 32, the
  LM head over ~1,000 nodes) included, which on a GPU are device work;
* host ms: the step's wall time outside operators (the profiler's operator self-times;
  native calls are marked as operators, as torch's own are): the Python between the
  operators and their dispatch, what the host spends on a step while, on a GPU, the
  device computes; measured on other steps than the timed ones, under the profiler
  (whose own cost per operator falls outside the operators too: a side that calls more
  operators pays more of it);
* operators called per step from Python (the profiler's top-level events);
* the step's copies: host syncs (device to host) and uploads (host to device).

With ``base`` (an older checkout), each cell is measured on both sides, each in a fresh
subprocess (``treespark.bench.sides``): this file runs there with the older
``treespark`` on the path, so it uses only the engine interface both share.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def outside_operators(prof, wall_s: float) -> tuple[float, int]:
    """What a profiler run of ``wall_s`` seconds says of the host: the seconds outside
    operators (the wall time less the operators' self-times; ``##`` annotations and
    profiler steps are not operators, native calls marked as operators are) and the
    operators called from Python (the top-level events: a nested operator's bookkeeping
    is inside its caller's time)."""
    ops = [e for e in prof.events() if not e.name.startswith(("##", "ProfilerStep"))]
    return max(0.0, wall_s - sum(e.self_cpu_time_total for e in ops) / 1e6), sum(e.cpu_parent is None for e in ops)


def host_budget():
    """Trees of 32 nodes, 4 children a node."""
    from treespark.spec.budget import Budget

    return Budget(0.0, 32, 4)


def batch_engine(pair, batch: int, temperature: float, steps: int, seed: int = 0):
    """An engine whose ``batch`` requests all decode, with room for ``steps`` steps of
    trees after a warm-up one: the batch is filled with plain decoding (each request's
    prefill), so that only the steps that follow draft. Its budget is still plain."""
    from treespark.spec.budget import Budget
    from treespark.spec.params import SamplingParams

    try:
        from treespark.engine.config import EngineConfig
    except ImportError:   # an older checkout defines it beside the engine
        from treespark.engine.core import EngineConfig
    from treespark.engine.core import Engine

    new = batch + 8 * (steps + 2)  # plain tokens while the batch fills, then <= 8 a round
    eng = Engine(pair, EngineConfig(max_batch_size=batch, max_context=8 + new), budget=Budget.off())
    for i in range(batch):
        eng.add_request(f"r{i}", [(7 * i + j) % pair.vocab_size for j in range(1, 9)],
                        SamplingParams(temperature=temperature, max_tokens=new, seed=seed + i))
    while eng.num_waiting:
        eng.step()
    return eng


def measure(*, vocab_size: int, markov_rank: int, block_size: int, family: str, draft_vocab: int, batch: int,
            temperature: float, steps: int, seed: int = 0) -> dict:
    """One side's figures for one cell (the module docstring): a warm-up step, ``steps``
    timed steps, then ``steps`` profiled ones."""
    from torch.profiler import ProfilerActivity, profile

    from treespark.models.pair import random_pair

    pair = random_pair(vocab_size, seed, block_size, markov_rank=markov_rank, family=family,
                       draft_vocab=draft_vocab)
    eng = batch_engine(pair, batch, temperature, 2 * steps, seed)
    eng.set_budget(host_budget())
    stats = []
    eng.on_step = stats.append
    eng.step()
    cpu, wall, host, ops = [], [], [], []
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        eng.step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            eng.step()
            w = time.perf_counter() - t0
        outside, called = outside_operators(prof, w)
        host.append(outside)
        ops.append(called)
    timed = stats[1:1 + steps]
    med = statistics.median
    return {"cpu_ms": 1e3 * med(cpu), "wall_ms": 1e3 * med(wall), "host_ms": 1e3 * med(host), "ops": med(ops),
            "nodes": med(sum(s.tree_sizes) for s in timed), "syncs": max(s.host_syncs for s in timed),
            "uploads": max(getattr(s, "host_uploads", 0) for s in timed)}


def host_benchmark(*, vocab_size: int = 151_936, markov_rank: int = 256, block_size: int = 7,
                   family: str = "qwen3", draft_vocab: int = 0, batch_sizes=(32,), temperatures=(0.0, 1.0),
                   steps: int = 3, seed: int = 0, base: Path | None = None, log=print) -> str:
    """The table (the module docstring): a row a side and cell, and with ``base`` the
    after / before ratios of CPU and host ms."""
    from treespark.bench.common import markdown_table
    from treespark.bench.sides import in_turn, run_at

    rows = []
    for b in batch_sizes:
        for t in temperatures:
            args = ["--measure", "--vocab-size", str(vocab_size), "--markov-rank", str(markov_rank),
                    "--block-size", str(block_size), "--family", family, "--draft-vocab", str(draft_vocab),
                    "--batch", str(b), "--temperature", str(t), "--steps", str(steps), "--seed", str(seed)]
            sides = {label: ms[0] for label, ms in
                     in_turn(base, 1, lambda checkout, args=args: run_at(checkout, __file__, args)).items()}
            for label, m in sides.items():
                rows.append([str(b), f"{t:g}", label, f"{m['cpu_ms']:.0f}", f"{m['wall_ms']:.0f}",
                             f"{m['host_ms']:.0f}", f"{m['ops']:.0f}", f"{m['nodes']:.0f}", str(m["syncs"]),
                             str(m["uploads"])])
                log(" | ".join(rows[-1]))
            if base is not None:
                a, z = sides["after"], sides["before"]
                rows.append([str(b), f"{t:g}", "after / before", f"{a['cpu_ms'] / z['cpu_ms']:.2f}",
                             f"{a['wall_ms'] / z['wall_ms']:.2f}", f"{a['host_ms'] / z['host_ms']:.2f}",
                             f"{a['ops'] / z['ops']:.2f}", "", "", ""])
                log(" | ".join(rows[-1]))
    return markdown_table(["batch", "T", "engine", "CPU ms per step", "wall ms", "host ms (outside operators)",
                           "operators called", "nodes in the step", "host syncs (max)", "uploads (max)"], rows)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true", required=True)
    for name, kind in (("vocab-size", int), ("markov-rank", int), ("block-size", int), ("family", str),
                       ("draft-vocab", int), ("batch", int), ("temperature", float), ("steps", int), ("seed", int)):
        ap.add_argument(f"--{name}", type=kind, required=True)
    a = vars(ap.parse_args())
    a.pop("measure")
    print(json.dumps(measure(**a)))

"""``treespark bench serving``: what the KV memory and the scheduler serve, on a tiny
random pair (plain decoding: the numbers are about memory and scheduling, not trees).

Three measurements, each on a fresh engine:

* held at once: 64 chats of 300 tokens (200 prompt + 100 generated) arriving together,
  at a KV budget of 8 dense rows of max_context 2048; the most requests holding KV at
  once (``Engine.kv_rows_in_use``), and how many preemptions it took (requests are
  admitted by their prompts' blocks, and some are preempted as they grow);
* TTFT: a burst of 16 requests with long prompts arriving together; seconds from the
  burst to each request's first token, p50 and p95;
* prefix cache: 4 conversations of 4 turns over one shared ~500-token system prompt
  (turn t's prompt: the previous prompt, its answer and a new user message); the
  prefix-cache hit rate (tokens) and the prefill positions computed per prompt token
  received.

Only the engine's public interface is used, so the same measurement runs against an
older checkout (``--base``, run in a subprocess with that checkout first on the path);
an engine without the prefix-cache counters computes every prompt token.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PAIRS = ("qwen3", "llama")


def _pair(name: str):
    from treespark import random_pair

    if name == "qwen3":
        return random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3")
    return random_pair(512, 0)


def _run(engine, requests, *, until_first: bool = False) -> tuple[dict[str, float], int]:
    """Add every request at once, step to the end; (seconds to each first token, peak
    requests holding KV)."""
    from treespark.spec.params import SamplingParams

    t0 = time.perf_counter()
    for rid, prompt, n in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n))
    first: dict[str, float] = {}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
        peak = max(peak, engine.kv_rows_in_use)
        if until_first and len(first) == len(requests):
            for rid, _, _ in requests:
                engine.abort(rid)
    return first, peak


def measure(pair_name: str, burst_prompt: int = 1500) -> dict:
    import torch

    from treespark import Budget
    from treespark.engine.core import Engine, EngineConfig
    from treespark.engine.kv import bytes_per_token

    torch.manual_seed(0)
    pair = _pair(pair_name)
    vocab = pair.target.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    out: dict = {"pair": pair_name}
    # held at once, at a KV budget of 8 dense rows of max_context 2048 (the dense rule:
    # max_context + max_tree_nodes + 1 positions a row)
    probe = Engine(pair, EngineConfig(max_batch_size=1, max_context=64))
    dc = pair.drafter.config
    from treespark.engine.kv import StoreShape

    per_token = bytes_per_token(probe.runner.store_shape,
                                StoreShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim),
                                probe.runner.dtype)
    budget = 8 * (2048 + 64 + 1) * per_token
    engine = Engine(pair, EngineConfig(max_batch_size=128, max_context=2048, kv_budget_bytes=budget),
                    budget=Budget.off())
    _, out["held"] = _run(engine, [(f"c{i}", tokens(200), 100) for i in range(64)])
    out["preempted"] = getattr(engine, "preemptions", 0)  # (a dense engine queues instead)
    out["kv_budget_mib"] = budget / 2**20
    # TTFT of a burst of 16 long prompts
    engine = Engine(pair, EngineConfig(max_batch_size=16, max_context=burst_prompt + 64), budget=Budget.off())
    first, _ = _run(engine, [(f"b{i}", tokens(burst_prompt), 8) for i in range(16)], until_first=True)
    ttft = sorted(first.values())
    out["ttft_p50"], out["ttft_p95"] = statistics.median(ttft), ttft[int(0.95 * (len(ttft) - 1) + 0.5)]
    out["burst_prompt"] = burst_prompt
    # prefix cache: 4 conversations x 4 turns over one shared system prompt
    engine = Engine(pair, EngineConfig(max_batch_size=8, max_context=2048), budget=Budget.off())
    system = tokens(500)
    convs = [system + tokens(40) for _ in range(4)]
    received = 0
    for turn in range(4):
        reqs = [(f"t{turn}c{i}", c, 32) for i, c in enumerate(convs)]
        received += sum(len(c) for c in convs)
        answers: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
        for rid, prompt, n in reqs:
            from treespark.spec.params import SamplingParams

            engine.add_request(rid, prompt, SamplingParams(max_tokens=n))
        while engine.has_unfinished():
            for o in engine.step():
                answers[o.request_id] += o.new_token_ids
        convs = [c + answers[f"t{turn}c{i}"] + tokens(40) for i, c in enumerate(convs)]
    computed = getattr(engine, "prefill_computed", received)
    out["hit_rate"] = getattr(engine, "prefix_cache_hits", 0) / getattr(engine, "prefix_cache_queries", received)
    out["computed_per_received"] = computed / received
    out["prompt_tokens"] = received
    return out


def _measure_at(checkout: Path | None, pair: str, burst_prompt: int) -> dict:
    """``measure`` in a subprocess whose ``treespark`` is the one of ``checkout`` (None:
    this one)."""
    root = checkout or Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", pair, "--burst-prompt", str(burst_prompt)]
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def serving_benchmark(pairs: tuple[str, ...] = PAIRS, *, base: Path | None = None,
                      burst_prompt: int = 1500) -> str:
    from treespark.bench.common import markdown_table

    rows = []
    for pair in pairs:
        runs = ([("before", _measure_at(base, pair, burst_prompt))] if base is not None else [])
        runs.append(("after", _measure_at(None, pair, burst_prompt)))
        for label, m in runs:
            rows.append([pair, label, f"{m['held']} ({m['preempted']})", f"{m['ttft_p50']:.2f} / {m['ttft_p95']:.2f}",
                         f"{m['hit_rate']:.2f}", f"{m['computed_per_received']:.2f}"])
    m = runs[-1][1]
    header = ["pair", "engine", f"300-token chats held at once (preempted) ({m['kv_budget_mib']:.1f} MiB KV)",
              f"TTFT p50 / p95 s (16 x {burst_prompt}-token burst)", "prefix-cache hit rate",
              "prefill computed / prompt received"]
    note = ("\n\nPlain decoding, 1 thread; random pairs: qwen3 = `random_pair(151936, 0, block_size=5, "
            "markov_rank=16, family=\"qwen3\")`, llama = `random_pair(512, 0)`. Held at once: 64 chats "
            "(200 prompt + 100 generated tokens) arriving together at the KV bytes of 8 dense rows of "
            "max_context 2048. Prefix cache: 4 conversations x 4 turns (40-token user messages, 32-token "
            "answers) over one shared 500-token system prompt. An engine without prefix caching computes "
            "every prompt token.\n")
    return markdown_table(header, rows) + note


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", required=True, choices=PAIRS)
    ap.add_argument("--burst-prompt", type=int, default=1500)
    a = ap.parse_args()
    print(json.dumps(measure(a.measure, a.burst_prompt)))

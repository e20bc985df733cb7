"""``treespark bench serving``: what the KV memory and the scheduler serve, on a tiny
random pair (plain decoding, but for the long-context steps: the numbers are about
memory and scheduling, not trees).

Four measurements, each on a fresh engine:

* held at once: 64 chats of 300 tokens (200 prompt + 100 generated) arriving together,
  at a KV budget of 8 dense rows of max_context 2048; the most requests holding KV at
  once (``Engine.kv_rows_in_use``), and how many preemptions it took (requests are
  admitted by their prompts' blocks, and some are preempted as they grow);
* TTFT: a burst of 16 requests with long prompts arriving together; the process's CPU
  seconds from the burst to each request's first token, p50 and p95, and the CPU seconds
  between the tokens of the requests already decoding while the rest prefill (their
  inter-token latency), p95. CPU time, not wall time: on a shared machine a wall clock
  adds the other jobs' turns (one thread: the CPU time is the time the engine computes);
* long context (the qwen3 pair only): 8 requests with 4,096-token prompts (prefilled
  under plain decoding) decoding with 16-node trees; the median over steps of the
  step's verify stage (``StepStats.verify_s``: the verify forward, acceptance and
  commit), of the whole step's CPU time, and the peak bytes one step allocates above
  what it started with (``peak_bytes``);
* prefix cache: 4 conversations of 4 turns over one shared ~500-token system prompt
  (turn t's prompt: the previous prompt, its answer and a new user message); the
  prefix-cache hit rate (tokens) and the prefill positions computed per prompt token
  received.

``--burst-pair default`` instead: the burst alone on the default pair, whose prefill is
compute-bound on a CPU, before (float32: the dense engine's only precision) and after at
float32 and at the served precision (bfloat16), with ``--burst-budgets`` at each of
those token budgets a step.

``--goodput`` instead: decode goodput (tokens/s, plain decoding and the adaptive tree,
T = 0) at a few batch sizes on the default pair and the qwen3 random pair, before and
after: the KV memory and the scheduler must not slow the decoding they serve.

Only the engine's public interface is used, so the same measurement runs against an
older checkout (``--base``, run in a subprocess with that checkout first on the path);
an engine without the prefix-cache counters computes every prompt token. The timed
figures are the median of a few runs a side, the sides taking turns.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

PAIRS = ("qwen3", "llama")
GOODPUT_PAIRS = ("default", "qwen3")
GOODPUT_DECODERS = ("plain", "adaptive")


def _pair(name: str, precision: str = "float32"):
    from treespark import random_pair

    if name == "default":
        from treespark.models.pair import pair_by_name

        # (an older checkout's pair_by_name takes no precision: it is only passed where not float32)
        return pair_by_name("default", **({} if precision == "float32" else {"precision": precision}))
    if name == "qwen3":
        return random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3")
    return random_pair(512, 0)


def _engine_classes():
    """(Engine, EngineConfig) of whichever checkout is on the path (an older one defines
    both in ``treespark.engine.core``)."""
    from treespark.engine.core import Engine

    try:
        from treespark.engine.config import EngineConfig
    except ImportError:
        from treespark.engine.core import EngineConfig
    return Engine, EngineConfig


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes ``fn`` holds at once above what it started with: the peak of the
    running sum of the profiler's allocation events (``profile_memory=True``), in time
    order. (Here, torch only, since this module also measures older checkouts.)"""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    return int(max(np.cumsum([n for _, n in events]).max(initial=0), 0))


def _run(engine, requests, *, until_first: bool = False) -> tuple[dict[str, float], int, list[float], int]:
    """Add every request at once, step to the end; (CPU seconds to each first token, peak
    requests holding KV, CPU seconds between a request's later tokens, steps taken)."""
    from treespark.spec.params import SamplingParams

    t0 = time.process_time()
    for rid, prompt, n in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    peak = steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.process_time() - t0
        for out in outs:
            if not out.new_token_ids:
                continue
            if out.request_id in first:
                gaps.append(now - last[out.request_id])
            else:
                first[out.request_id] = now
            last[out.request_id] = now
        peak = max(peak, engine.kv_rows_in_use)
        if until_first and len(first) == len(requests):
            for rid, _, _ in requests:
                engine.abort(rid)
    return first, peak, gaps, steps


def _p95(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[int(0.95 * (len(ordered) - 1) + 0.5)]


def long_context(pair, tokens: Callable[[int], list[int]], *, batch: int = 8, context: int = 4096,
                 nodes: int = 16, steps: int = 5) -> dict:
    """Decode steps of ``batch`` requests at ``context``-token prompts with ``nodes``-node
    trees (theta 0: every drafted node is verified): medians of the verify stage (wall
    ms, ``StepStats.verify_s``) and of the step's CPU ms, and one step's peak MiB."""
    from treespark import Budget
    Engine, EngineConfig = _engine_classes()
    from treespark.spec.params import SamplingParams

    # plain decoding while the prompts are prefilled (the first requests decode meanwhile,
    # at most a token a step), then the trees
    engine = Engine(pair, EngineConfig(max_batch_size=batch, max_context=context + 256, max_tree_nodes=nodes),
                    budget=Budget.off())
    for i in range(batch):
        engine.add_request(f"l{i}", tokens(context), SamplingParams(max_tokens=256))
    while engine.num_waiting or engine.num_running < batch:
        engine.step()
    engine.set_budget(Budget(theta=0.0, node_cap=nodes - 1, branch_cap=4))
    engine.step()  # warm: every row drafting and verifying its tree
    verify: list[float] = []
    engine.on_step = lambda st: verify.append(st.verify_s)
    cpu = []
    for _ in range(steps):
        t = time.process_time()
        engine.step()
        cpu.append(time.process_time() - t)
    engine.on_step = None
    peak = peak_bytes(engine.step)
    return {"long_verify_ms": 1e3 * statistics.median(verify), "long_step_ms": 1e3 * statistics.median(cpu),
            "long_peak_mib": peak / 2**20, "long_batch": batch, "long_context": context, "long_nodes": nodes}


def measure(pair_name: str, part: str, burst_prompt: int = 1500, batch_sizes: tuple[int, ...] = (1, 4, 16),
            precision: str = "float32", budget: int | None = None) -> dict:
    """One side's figures: ``part`` "counts" (held at once, prefix cache: the same in
    every run), "timing" (the burst, and for qwen3 the long-context steps) or "goodput"
    (decode tokens/s at ``batch_sizes``); ``precision``: the default pair's weights;
    ``budget``: the burst's tokens a step (``burst``'s)."""
    import torch

    from treespark import Budget
    Engine, EngineConfig = _engine_classes()
    from treespark.engine.kv import StoreShape, bytes_per_token
    from treespark.spec.params import SamplingParams

    torch.manual_seed(0)
    pair = _pair(pair_name, precision)
    vocab = pair.target.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    out: dict = {"pair": pair_name}
    if part == "goodput":
        out.update(goodput(pair, batch_sizes))
        return out
    if part == "timing":
        # TTFT of a burst of 16 long prompts, and the decoding requests' gaps meanwhile
        b = burst(pair, tokens, budget=budget, prompt=burst_prompt)
        out.update(ttft_p50=b["ttft_p50"], ttft_p95=b["ttft_p95"], itl_p95=b["itl_p95"])
        if pair_name == "qwen3":
            out.update(long_context(pair, tokens))
        return out
    # held at once, at a KV budget of 8 dense rows of max_context 2048 (the dense rule:
    # max_context + max_tree_nodes + 1 positions a row)
    probe = Engine(pair, EngineConfig(max_batch_size=1, max_context=64))
    dc = pair.drafter.config
    per_token = bytes_per_token(probe.runner.store_shape,
                                StoreShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim),
                                probe.runner.dtype)
    budget = 8 * (2048 + 64 + 1) * per_token
    engine = Engine(pair, EngineConfig(max_batch_size=128, max_context=2048, kv_budget_bytes=budget),
                    budget=Budget.off())
    _, out["held"], _, _ = _run(engine, [(f"c{i}", tokens(200), 100) for i in range(64)])
    out["preempted"] = getattr(engine, "preemptions", 0)  # (a dense engine queues instead)
    out["kv_budget_mib"] = budget / 2**20
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


def goodput(pair, batch_sizes: tuple[int, ...], *, max_tokens: int = 48) -> dict[str, float]:
    """Decode tokens/s (wall clock) of plain decoding and the adaptive tree at each batch
    size: one batch of ``bs`` held-out prompts (random ones for a random pair), T = 0,
    after one warm-up request per decoder; keys ``"{bs}/{decoder}"``."""
    from treespark import Budget
    from treespark.engine.run import run_engine
    from treespark.models.prompts import pair_prompts

    budgets = {"plain": Budget.off(), "adaptive": Budget.adaptive()}
    for b in budgets.values():
        run_engine(pair, pair_prompts(pair, 1), b, max_tokens=8, batch_size=1)
    return {f"{bs}/{name}": run_engine(pair, pair_prompts(pair, bs), budgets[name], max_tokens=max_tokens,
                                       batch_size=bs).tokens_per_s
            for bs in batch_sizes for name in GOODPUT_DECODERS}


def burst(pair, tokens: Callable[[int], list[int]], *, budget: int | None = None, prompt: int = 1500,
          requests: int = 16) -> dict:
    """The burst on a fresh engine whose steps carry at most ``budget`` tokens
    (``EngineConfig.max_num_batched_tokens``; chunks of up to 256 a request; None: the
    engine's default, and the only choice of an older checkout's): TTFT p50 and
    p95 and the decoding requests' ITL p95, CPU seconds; the steps until every request's
    first token, and how many had one."""
    from treespark import Budget
    Engine, EngineConfig = _engine_classes()

    per_step = {} if budget is None else {"max_num_batched_tokens": budget}
    engine = Engine(pair, EngineConfig(max_batch_size=requests, max_context=prompt + 64, **per_step),
                    budget=Budget.off())
    first, _, gaps, steps = _run(engine, [(f"b{i}", tokens(prompt), 8) for i in range(requests)],
                                 until_first=True)
    return {"ttft_p50": statistics.median(first.values()), "ttft_p95": _p95(list(first.values())),
            "itl_p95": _p95(gaps), "steps": steps, "answered": len(first)}


def burst_frontier(budgets: tuple[int, ...], *, pair_name: str = "qwen3", prompt: int = 1500,
                   rounds: int = 3) -> str:
    """The burst at each token budget a step, the budgets taking turns ``rounds`` times
    (one thread, this process): medians, and each against the smallest budget. The
    budget trades TTFT (fewer, larger prefill steps) against the running requests' ITL
    (each step carries more prompt tokens)."""
    import torch

    from treespark.bench.common import markdown_table

    torch.set_num_threads(1)
    pair = _pair(pair_name)
    vocab = pair.target.config.vocab_size
    runs: dict[int, list[dict]] = {b: [] for b in budgets}
    for r in range(rounds):
        for b in budgets:
            g = torch.Generator().manual_seed(r)   # the same prompts for every budget in a round
            runs[b].append(burst(pair, lambda n, g=g: torch.randint(0, vocab, (n,), generator=g).tolist(),
                                 budget=b, prompt=prompt))
    med = {b: {k: statistics.median(x[k] for x in runs[b]) for k in runs[b][0]} for b in budgets}
    ref = med[min(budgets)]
    rows = [[str(b), f"{m['ttft_p50']:.2f} / {m['ttft_p95']:.2f}", f"{1e3 * m['itl_p95']:.0f}",
             f"{m['ttft_p50'] / ref['ttft_p50']:.2f} / {m['ttft_p95'] / ref['ttft_p95']:.2f}",
             f"{m['itl_p95'] / ref['itl_p95']:.2f}"] for b, m in med.items()]
    return (markdown_table(["tokens a step", "TTFT p50 / p95 CPU s", "ITL p95 CPU ms",
                            f"TTFT p50 / p95 vs {min(budgets)}", f"ITL p95 vs {min(budgets)}"], rows)
            + f"\n\n16 x {prompt}-token prompts arriving together, 8 tokens each, plain decoding, on the {pair_name} "
              f"random pair; 1 thread; medians of {rounds} rounds, the budgets in turn within each round.\n")


def _measure_at(checkout: Path | None, pair: str, part: str, burst_prompt: int = 1500,
                batch_sizes: tuple[int, ...] = (1, 4, 16), precision: str = "float32",
                budget: int | None = None) -> dict:
    """``measure`` in a subprocess whose ``treespark`` is the one of ``checkout`` (None:
    this one); this file runs it, whichever checkout it is measuring."""
    from treespark.bench.sides import run_at

    return run_at(checkout, __file__, ["--measure", pair, "--part", part, "--burst-prompt", str(burst_prompt),
                                       "--batch-sizes", *map(str, batch_sizes), "--precision", precision,
                                       *(["--budget", str(budget)] if budget is not None else [])])


TIMED = ("ttft_p50", "ttft_p95", "itl_p95", "long_verify_ms", "long_step_ms", "long_peak_mib")


def _timings(base: Path | None, pair: str, burst_prompt: int, rounds: int) -> dict[str, dict]:
    """The timed figures of each side, the median over ``rounds`` runs taken in turn
    (``treespark.bench.sides.in_turn``)."""
    from treespark.bench.sides import in_turn

    runs = in_turn(base, rounds, lambda checkout: _measure_at(checkout, pair, "timing", burst_prompt))
    return {label: {k: statistics.median(m[k] for m in ms) for k in TIMED if k in ms[0]} for label, ms in runs.items()}


def default_burst_benchmark(base: Path | None, *, precisions: tuple[str, ...] = ("float32", "bfloat16"),
                            budgets: tuple[int | None, ...] = (None,), burst_prompt: int = 1500) -> str:
    """The burst on the default pair, once a side (a side takes minutes): before (``base``,
    float32, its engine's one prompt chunk a step) and after at each of ``precisions`` and
    token ``budgets`` a step (None: the engine's default), the sides in turn (before
    first), each a fresh subprocess, 1 thread; after / before beside each after row."""
    from treespark.bench.common import markdown_table

    runs = [("before, float32", _measure_at(base, "default", "timing", burst_prompt))] if base is not None else []
    runs += [(f"after, {p}" + ("" if b is None else f", {b} tokens a step"),
              _measure_at(None, "default", "timing", burst_prompt, precision=p, budget=b))
             for p in precisions for b in budgets]
    ref = runs[0][1] if base is not None else None
    rows = []
    for label, m in runs:
        ratio = "" if ref is None or m is ref else (
            f"{m['ttft_p50'] / ref['ttft_p50']:.2f} / {m['ttft_p95'] / ref['ttft_p95']:.2f} / "
            f"{m['itl_p95'] / ref['itl_p95']:.2f}")
        rows.append([label, f"{m['ttft_p50']:.1f} / {m['ttft_p95']:.1f}", f"{m['itl_p95']:.2f}", ratio])
    return (markdown_table(["engine, weights", "TTFT p50 / p95 CPU s", "ITL p95 CPU s",
                            "TTFT p50 / p95, ITL p95 vs before"], rows)
            + f"\n\n16 x {burst_prompt}-token prompts arriving together, 8 tokens each, plain decoding, on the "
              "default pair (SmolLM2-135M); the engine's default token budget a step where a row names none; "
              "1 thread, CPU seconds; one run a side.\n")


def goodput_benchmark(base: Path | None, batch_sizes: tuple[int, ...] = (1, 4, 16),
                      pairs: tuple[str, ...] = GOODPUT_PAIRS, rounds: int = 3) -> str:
    """Decode goodput of this checkout (after) and of ``base`` (before), the sides in
    turn over ``rounds`` rounds (each side a fresh subprocess a round, 1 thread): the
    medians, and after / before."""
    from treespark.bench.common import markdown_table
    from treespark.bench.sides import in_turn

    rows = []
    for pair in pairs:
        runs = in_turn(base, rounds, lambda checkout, pair=pair: _measure_at(checkout, pair, "goodput",
                                                                               batch_sizes=batch_sizes))
        med = {label: {k: statistics.median(m[k] for m in ms) for k in ms[0] if k != "pair"}
               for label, ms in runs.items()}
        for bs in batch_sizes:
            cells = []
            for name in GOODPUT_DECODERS:
                key = f"{bs}/{name}"
                cell = " / ".join(f"{med[label][key]:.1f}" for label in med)
                if base is not None:
                    cell += f" ({med['after'][key] / med['before'][key]:.2f}x)"
                cells.append(cell)
            rows.append([pair, str(bs), *cells])
    head = ("before / after (after / before)" if base is not None else "after")
    return (markdown_table(["pair", "batch", *(f"{n} tok/s, {head}" for n in GOODPUT_DECODERS)], rows)
            + f"\n\nOne batch of held-out prompts (random ones on the random pair), 48 tokens each, T = 0, "
              f"1 thread, wall clock; the median of {rounds} rounds, the sides in turn, each a fresh process. "
              "default: SmolLM2-135M with the shipped drafter; qwen3: `random_pair(151936, 0, block_size=5, "
              "markov_rank=16, family=\"qwen3\")` (its drafter accepts almost nothing: the adaptive row is "
              "the cost of drafting).\n")


def serving_benchmark(pairs: tuple[str, ...] = PAIRS, *, base: Path | None = None,
                      burst_prompt: int = 1500, rounds: int = 3) -> str:
    from treespark.bench.common import markdown_table

    rows, long_rows = [], []
    for pair in pairs:
        timed = _timings(base, pair, burst_prompt, rounds)
        runs = [(label, {**_measure_at(base if label == "before" else None, pair, "counts", burst_prompt),
                         **timed[label]}) for label in timed]
        for label, m in runs:
            rows.append([pair, label, f"{m['held']} ({m['preempted']})", f"{m['ttft_p50']:.2f} / {m['ttft_p95']:.2f}",
                         f"{1e3 * m['itl_p95']:.0f}", f"{m['hit_rate']:.2f}", f"{m['computed_per_received']:.2f}"])
            if "long_verify_ms" in m:
                long_rows.append([pair, label, f"{m['long_verify_ms']:.1f}", f"{m['long_step_ms']:.1f}",
                                  f"{m['long_peak_mib']:.1f}"])
        if len(runs) == 2:
            (_, b), (_, a) = runs
            rows.append([pair, "after / before", "", f"{a['ttft_p50'] / b['ttft_p50']:.2f} / "
                         f"{a['ttft_p95'] / b['ttft_p95']:.2f}", f"{a['itl_p95'] / b['itl_p95']:.2f}", "", ""])
            if "long_verify_ms" in a:
                long_rows.append([pair, "after / before", f"{a['long_verify_ms'] / b['long_verify_ms']:.2f}",
                                  f"{a['long_step_ms'] / b['long_step_ms']:.2f}",
                                  f"{a['long_peak_mib'] / b['long_peak_mib']:.2f}"])
    m = runs[-1][1]
    header = ["pair", "engine", f"300-token chats held at once (preempted) ({m['kv_budget_mib']:.1f} MiB KV)",
              f"TTFT p50 / p95 CPU s (16 x {burst_prompt}-token burst)", "ITL p95 CPU ms (during the burst)",
              "prefix-cache hit rate", "prefill computed / prompt received"]
    note = ("\n\nPlain decoding, 1 thread; random pairs: qwen3 = `random_pair(151936, 0, block_size=5, "
            "markov_rank=16, family=\"qwen3\")`, llama = `random_pair(512, 0)`. Held at once: 64 chats "
            "(200 prompt + 100 generated tokens) arriving together at the KV bytes of 8 dense rows of "
            "max_context 2048. Prefix cache: 4 conversations x 4 turns (40-token user messages, 32-token "
            "answers) over one shared 500-token system prompt. An engine without prefix caching computes "
            f"every prompt token. Timed figures: the median of {rounds} runs a side, the sides in turn.\n")
    table = markdown_table(header, rows) + note
    if long_rows:
        table += ("\nLong context (qwen3): 8 requests with 4,096-token prompts, decoding with 16-node trees "
                  "(theta 0, branch cap 4); medians over 5 steps after a warm one, then one step profiled.\n\n")
        table += markdown_table(["pair", "engine", "verify stage wall ms", "step CPU ms", "step peak MiB"], long_rows)
    return table


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", required=True, choices=sorted({*PAIRS, *GOODPUT_PAIRS}))
    ap.add_argument("--part", required=True, choices=["counts", "timing", "goodput"])
    ap.add_argument("--burst-prompt", type=int, default=1500)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--precision", default="float32")
    ap.add_argument("--budget", type=int)
    a = ap.parse_args()
    print(json.dumps(measure(a.measure, a.part, a.burst_prompt, tuple(a.batch_sizes), a.precision, a.budget)))

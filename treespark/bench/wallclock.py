"""Single-request wall clock: our decoders vs transformers' greedy and prompt lookup."""

from __future__ import annotations

import time

import torch

from treespark.bench.common import bench_prompts, markdown_table, run_engine
from treespark.budget import Budget
from treespark.models import ModelPair


@torch.no_grad()
def _hf(pair: ModelPair, prompts, max_tokens: int, **kwargs) -> tuple[int, float]:
    tokens, t0 = 0, time.perf_counter()
    eos = pair.tokenizer.eos_token_id if pair.tokenizer is not None else None
    for p in prompts:
        ids = torch.tensor([p], device=pair.device)
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                   do_sample=False, eos_token_id=eos, pad_token_id=eos or 0, **kwargs)
        tokens += out.shape[1] - ids.shape[1]
    return tokens, time.perf_counter() - t0


def wallclock_benchmark(pair: ModelPair, *, n_prompts: int = 8, max_tokens: int = 96,
                        chains=(1, 2, 3, 4), budget: Budget | None = None, log=print) -> str:
    """Batch-1 tokens/s of the adaptive tree (``budget``, default ``Budget.adaptive()``),
    the fastest of the chains ``chains`` (tuned here, by wall clock), our plain
    decoding, and HF ``generate()`` greedy and prompt lookup, on the same prompts."""
    prompts = bench_prompts(pair, n_prompts)

    def tok_s(b: Budget) -> float:
        tokens, wall = 0, 0.0
        for p in prompts:  # one request at a time
            r = run_engine(pair, [p], b, max_tokens=max_tokens, batch_size=1)
            tokens, wall = tokens + r.tokens, wall + r.wall_s
        return tokens / wall

    results: dict[str, float] = {}
    results["adaptive tree"] = tok_s(budget or Budget.adaptive())
    log(f"adaptive tree: {results['adaptive tree']:.2f} tok/s")
    chain_speed = {}
    for k in chains:
        chain_speed[k] = tok_s(Budget.chain(k))
        log(f"chain k={k}: {chain_speed[k]:.2f} tok/s")
    best = max(chain_speed, key=chain_speed.get)
    results[f"tuned chain (k={best})"] = chain_speed[best]
    results["our plain decoding"] = tok_s(Budget.off())
    log(f"our plain decoding: {results['our plain decoding']:.2f} tok/s")
    for name, kwargs in {"HF generate greedy": {}, "HF prompt lookup": {"prompt_lookup_num_tokens": 10}}.items():
        tokens, wall = _hf(pair, prompts, max_tokens, **kwargs)
        results[name] = tokens / wall
        log(f"{name}: {results[name]:.2f} tok/s")
    ours = results["adaptive tree"]
    rows = [[k, f"{v:.2f}", f"{ours / v:.2f}x"] for k, v in results.items()]
    return markdown_table(["decoder (batch 1, greedy)", "tokens/s", "adaptive speed-up"], rows)


def theta_sweep(pair: ModelPair, *, thetas=(0.02, 0.05, 0.08, 0.12), chains=(2, 3, 4),
                n_prompts: int = 3, max_tokens: int = 48, log=print) -> str:
    """Batch-1 tokens/s of adaptive trees (node_cap 32, branch_cap 4) at several prices,
    beside chains and plain decoding, on the *tuning* prompts: how the default theta
    of ``Budget.adaptive`` is chosen without touching the heldout ones."""
    prompts = bench_prompts(pair, n_prompts, split="tune")
    budgets = {"plain": Budget.off()}
    budgets.update({f"adaptive theta={t:g}": Budget(t, 32, 4) for t in thetas})
    budgets.update({f"chain k={k}": Budget.chain(k) for k in chains})
    rows = []
    for name, b in budgets.items():
        tokens, wall, drafted, rounds = 0, 0.0, 0, 0
        for p in prompts:
            r = run_engine(pair, [p], b, max_tokens=max_tokens, batch_size=1)
            tokens, wall, drafted, rounds = tokens + r.tokens, wall + r.wall_s, drafted + r.drafted, rounds + r.rounds
        log(f"{name}: {tokens / wall:.2f} tok/s")
        rows.append([name, f"{tokens / wall:.2f}", f"{drafted / max(rounds, 1):.1f}"])
    return markdown_table(["budget (batch 1, greedy, tuning prompts)", "tokens/s", "mean tree size"], rows)

"""Single-request wall clock: our decoders vs transformers' greedy and prompt lookup."""

from __future__ import annotations

import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Batch1:
    tokens: int
    wall_s: float
    drafted: int
    rounds: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def _one_at_a_time(pair: ModelPair, prompts, budget: Budget, max_tokens: int) -> _Batch1:
    """Serve ``prompts`` one request at a time (batch 1) and add up the runs."""
    runs = [run_engine(pair, [p], budget, max_tokens=max_tokens, batch_size=1) for p in prompts]
    return _Batch1(sum(r.tokens for r in runs), sum(r.wall_s for r in runs),
                   sum(r.drafted for r in runs), sum(r.rounds for r in runs))


def wallclock_benchmark(pair: ModelPair, *, n_prompts: int = 8, max_tokens: int = 96,
                        chains=(1, 2, 3, 4), budget: Budget | None = None, log=print) -> str:
    """Batch-1 tokens/s of the adaptive tree (``budget``, default ``Budget.adaptive()``),
    the fastest of the chains ``chains`` (tuned here, by wall clock), our plain
    decoding, and HF ``generate()`` greedy and prompt lookup, on the same prompts."""
    prompts = bench_prompts(pair, n_prompts)

    def tok_s(b: Budget) -> float:
        return _one_at_a_time(pair, prompts, b, max_tokens).tokens_per_s

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
        r = _one_at_a_time(pair, prompts, b, max_tokens)
        log(f"{name}: {r.tokens_per_s:.2f} tok/s")
        rows.append([name, f"{r.tokens_per_s:.2f}", f"{r.drafted / max(r.rounds, 1):.1f}"])
    return markdown_table(["budget (batch 1, greedy, tuning prompts)", "tokens/s", "mean tree size"], rows)

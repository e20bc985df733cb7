"""Single-request wall clock: our decoders vs transformers' greedy and prompt lookup."""

from __future__ import annotations

import time

import torch

from treespark.bench.common import RunResult, bench_prompts, markdown_table, run_engine
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


def _breakdown(r: RunResult) -> list[str]:
    """Mean draft tree, draft ms and verify ms per decode step, tokens per round."""
    steps = [s for s in r.step_stats if s.prefill_tokens == 0]
    n = max(len(steps), 1)
    return [f"{r.drafted / max(r.rounds, 1):.1f}", f"{1e3 * sum(s.draft_s for s in steps) / n:.1f}",
            f"{1e3 * sum(s.verify_s for s in steps) / n:.1f}", f"{r.tau:.2f}"]


def _one_at_a_time(pair: ModelPair, prompts, budget: Budget, max_tokens: int) -> RunResult:
    """Serve ``prompts`` one request at a time (batch 1) and add up the runs, after an
    untimed warm-up request (so the first decoder timed pays no first-use costs)."""
    run_engine(pair, prompts[:1], budget, max_tokens=min(max_tokens, 16), batch_size=1)
    runs = [run_engine(pair, [p], budget, max_tokens=max_tokens, batch_size=1) for p in prompts]
    return RunResult(sum(r.tokens for r in runs), sum(r.wall_s for r in runs), sum(r.steps for r in runs),
                     sum(r.rounds for r in runs), sum(r.accepted for r in runs), sum(r.drafted for r in runs),
                     tuple(s for r in runs for s in r.step_stats))


def wallclock_benchmark(pair: ModelPair, *, n_prompts: int = 8, max_tokens: int = 96,
                        chains=(1, 2, 3, 4), budget: Budget | None = None, log=print) -> str:
    """Batch-1 tokens/s of the adaptive tree (``budget``, default ``Budget.adaptive()``),
    the fastest of the chains ``chains`` (tuned here, by wall clock), our plain
    decoding, and HF ``generate()`` greedy and prompt lookup, on the same prompts."""
    prompts = bench_prompts(pair, n_prompts)

    def run(b: Budget) -> RunResult:
        return _one_at_a_time(pair, prompts, b, max_tokens)

    results: dict[str, float] = {}
    breakdown: dict[str, list[str]] = {}
    ours = run(budget or Budget.adaptive())
    results["adaptive tree"], breakdown["adaptive tree"] = ours.tokens_per_s, _breakdown(ours)
    log(f"adaptive tree: {ours.tokens_per_s:.2f} tok/s")
    chain_runs = {}
    for k in chains:
        chain_runs[k] = run(Budget.chain(k))
        log(f"chain k={k}: {chain_runs[k].tokens_per_s:.2f} tok/s")
    best = max(chain_runs, key=lambda k: chain_runs[k].tokens_per_s)
    name = f"tuned chain (k={best})"
    results[name], breakdown[name] = chain_runs[best].tokens_per_s, _breakdown(chain_runs[best])
    plain = run(Budget.off())
    results["our plain decoding"], breakdown["our plain decoding"] = plain.tokens_per_s, _breakdown(plain)
    log(f"our plain decoding: {plain.tokens_per_s:.2f} tok/s")
    for name, kwargs in {"HF generate greedy": {}, "HF prompt lookup": {"prompt_lookup_num_tokens": 10}}.items():
        _hf(pair, prompts[:1], min(max_tokens, 16), **kwargs)  # warm-up, untimed
        tokens, wall = _hf(pair, prompts, max_tokens, **kwargs)
        results[name] = tokens / wall
        log(f"{name}: {results[name]:.2f} tok/s")
    rows = [[k, f"{v:.2f}", f"{ours.tokens_per_s / v:.2f}x", *breakdown.get(k, ["-"] * 4)]
            for k, v in results.items()]
    return markdown_table(["decoder (batch 1, greedy)", "tokens/s", "adaptive speed-up", "mean tree",
                           "draft ms / step", "verify ms / step", "tokens / round"], rows)


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

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
                        chain: int = 3, log=print) -> str:
    prompts = bench_prompts(pair, n_prompts)
    results: dict[str, float] = {}
    for name, budget in {"adaptive tree": Budget.adaptive(), f"tuned chain (k={chain})": Budget.chain(chain),
                         "our plain decoding": Budget.off()}.items():
        tokens, wall = 0, 0.0
        for p in prompts:  # one request at a time
            r = run_engine(pair, [p], budget, max_tokens=max_tokens, batch_size=1)
            tokens, wall = tokens + r.tokens, wall + r.wall_s
        results[name] = tokens / wall
        log(f"{name}: {results[name]:.2f} tok/s")
    for name, kwargs in {"HF generate greedy": {}, "HF prompt lookup": {"prompt_lookup_num_tokens": 10}}.items():
        tokens, wall = _hf(pair, prompts, max_tokens, **kwargs)
        results[name] = tokens / wall
        log(f"{name}: {results[name]:.2f} tok/s")
    ours = results["adaptive tree"]
    rows = [[k, f"{v:.2f}", f"{ours / v:.2f}x"] for k, v in results.items()]
    return markdown_table(["decoder (batch 1, greedy)", "tokens/s", "adaptive speed-up"], rows)

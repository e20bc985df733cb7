"""``treespark bench serving``: the burst (the token budget a step paces the prefill) and
the decode goodput a side measures."""

from __future__ import annotations

import torch

from treespark.bench.serving import burst, goodput


def test_a_larger_token_budget_admits_the_burst_in_fewer_steps(mimic16):
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, mimic16.target.config.vocab_size, (n,), generator=g).tolist()

    small = burst(mimic16, tokens, budget=256, prompt=300, requests=4)
    large = burst(mimic16, tokens, budget=1024, prompt=300, requests=4)
    assert small["answered"] == large["answered"] == 4
    # 1,200 prompt tokens in chunks of up to 256 a request: at least 5 steps at 256 a
    # step; at 1,024, four chunks a step (two steps)
    assert small["steps"] >= 1200 // 256 + 1 and large["steps"] <= small["steps"] // 2
    assert small["itl_p95"] > 0 and large["ttft_p50"] > 0


def test_goodput_times_every_decoder_at_every_batch_size(mimic16):
    rates = goodput(mimic16, (1, 2), max_tokens=4)
    assert sorted(rates) == ["1/adaptive", "1/plain", "2/adaptive", "2/plain"]
    assert all(r > 0 for r in rates.values())

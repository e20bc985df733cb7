"""``treespark bench serving``: the burst (the token budget a step paces the prefill), the
decode goodput a side measures, and the default pair's burst table."""

from __future__ import annotations

from pathlib import Path

import torch

from treespark.bench import serving
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


def test_the_default_pair_burst_sets_each_precision_and_budget_against_the_float32_before(monkeypatch):
    """The table's assembly alone (a side's run takes minutes): the before side measured
    on the base checkout at float32 with its own schedule, each after side at its
    precision and token budget, each after row's ratios over the before row's figures."""
    seen = []

    def side(checkout, pair, part, burst_prompt=1500, batch_sizes=(1, 4, 16), precision="float32", budget=None):
        seen.append((checkout, pair, part, precision, budget))
        scale = {None: 1.0, "float32": 1.0, "bfloat16": 0.5}[precision if checkout is None else None]
        itl = 2.0 if checkout else scale * (0.5 if budget == 256 else 1.0)
        return {"ttft_p50": 20.0 * scale, "ttft_p95": 40.0 * scale, "itl_p95": 0.8 * itl}

    monkeypatch.setattr(serving, "_measure_at", side)
    table = serving.default_burst_benchmark(Path("/base"))
    assert seen == [(Path("/base"), "default", "timing", "float32", None), (None, "default", "timing", "float32", None),
                    (None, "default", "timing", "bfloat16", None)]
    rows = [r for r in table.splitlines() if r.startswith("| before") or r.startswith("| after")]
    assert rows[0].endswith("| 20.0 / 40.0 | 1.60 |  |")
    assert rows[1].endswith("| 1.00 / 1.00 / 0.50 |") and rows[2].endswith("| 0.50 / 0.50 / 0.25 |")
    seen.clear()
    table = serving.default_burst_benchmark(Path("/base"), precisions=("bfloat16",), budgets=(256, 512))
    assert [s[3:] for s in seen] == [("float32", None), ("bfloat16", 256), ("bfloat16", 512)]
    rows = [r for r in table.splitlines() if r.startswith("| after")]
    assert rows[0].startswith("| after, bfloat16, 256 tokens a step |") and rows[0].endswith("| 0.50 / 0.50 / 0.12 |")
    assert rows[1].startswith("| after, bfloat16, 512 tokens a step |") and rows[1].endswith("| 0.50 / 0.50 / 0.25 |")

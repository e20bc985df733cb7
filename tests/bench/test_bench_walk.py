"""``treespark bench walk`` replays recorded walks eager and compiled, and compares them."""

from __future__ import annotations

from treespark.bench.walk import walk_benchmark


def test_the_walk_bench_replays_every_call_and_finds_them_equal():
    table = walk_benchmark(batch_sizes=(2,), backend="aot_eager", steps=2, vocab_size=512, log=lambda m: None)
    row = next(line for line in table.splitlines() if line.startswith("| 2 |"))
    assert row.rstrip(" |").endswith("2/2")  # two decode steps, two walks, the same outputs

"""The acceptance benchmark on a tiny random pair: every policy row, and the seed."""

from __future__ import annotations

from treespark import random_pair
from treespark.bench.acceptance import acceptance_benchmark


def _rows(table: str) -> dict[str, str]:
    """policy -> tau, from the markdown table."""
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    return {cells[1]: cells[2] for cells in rows}


def test_acceptance_table_rows_and_sampling_seed():
    pair = random_pair(64, 0, block_size=3)
    run = dict(n_prompts=3, max_tokens=12, temperatures=(1.0,), chain_lengths=[1, 2], log=lambda *a: None)
    a, again, other = (_rows(acceptance_benchmark(pair, seed=s, **run)) for s in (0, 0, 50))
    assert a["plain"] == "1.000"
    for name in ("fixed tree 16", "logq @ 16 nodes", "adaptive (theta 0.08, default)",
                 "adaptive (theta 0.01, cheap verify)", "adaptive (theta 0.003, cheap verify)"):
        assert name in a
    assert any(name.startswith("tuned chain (k=") for name in a)
    assert a == again          # the same seed draws the same tokens
    assert a != other          # another seed draws others

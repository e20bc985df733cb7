"""The acceptance benchmark on a tiny random pair: every policy row, and the seed."""

from __future__ import annotations

from treespark import random_pair
from treespark.bench.acceptance import acceptance_benchmark, goals_benchmark, reproducible_benchmark


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


def test_reproducible_rows_beside_the_walks():
    """One walk row and one reproducible row at each T > 0 (none at T = 0); the walk's
    row is the full table's adaptive default; the reproducible tokens are plain decoding's."""
    pair = random_pair(64, 0, block_size=3)
    kw = dict(n_prompts=3, max_tokens=12, log=lambda *a: None)
    rows = [line.split(" | ") for line in reproducible_benchmark(pair, temperatures=(0.0, 1.0), **kw).splitlines()[2:]]
    assert [(c[0].strip("| "), c[1]) for c in rows] == [("1", "rejection walk"), ("1", "reproducible (Gumbel coupling)")]
    assert rows[0][4] == "1.000" and rows[1][5].strip(" |") == "yes"
    full = _rows(acceptance_benchmark(pair, temperatures=(1.0,), chain_lengths=[1], **kw))
    assert full["adaptive (theta 0.08, default)"] == rows[0][2]


def test_goal_rows_are_the_full_tables():
    pair = random_pair(8, 4, block_size=3)
    kw = dict(n_prompts=3, max_tokens=12, chain_lengths=[1, 2], log=lambda *a: None)
    goals = [line.split(" | ") for line in goals_benchmark(pair, **kw).splitlines()[2:]]
    full = {(c[0].strip("| "), c[1]): c[2] for c in (line.split(" | ") for line in acceptance_benchmark(
        pair, temperatures=(0.0, 1.0), **kw).splitlines()[2:])}
    first = {c[0].strip("| "): float(c[2]) for c in goals if c[1].startswith("first-token")}
    for cells in goals:
        t, name, tau = cells[0].strip("| "), cells[1], cells[2]
        if name.startswith("tuned chain"):
            assert full[(t, name)] == tau
            if name == "tuned chain (k=1)":
                assert abs(float(tau) - 1 - first[t]) < 1e-3
        elif name.startswith("adaptive"):
            theta = name.split("theta ")[1].rstrip(")")
            assert full[(t, f"adaptive (theta {theta}, cheap verify)")] == tau


def test_goal_rows_at_one_temperature_are_those_rows_of_both():
    pair = random_pair(8, 4, block_size=3)
    kw = dict(n_prompts=3, max_tokens=12, chain_lengths=[1, 2], log=lambda *a: None)
    both = goals_benchmark(pair, **kw).splitlines()
    one = goals_benchmark(pair, temperatures=(1.0,), **kw).splitlines()
    assert one[:2] == both[:2] and one[2:] == [line for line in both[2:] if line.startswith("| 1 |")]
    assert len(one) == 5


def test_variant_rows_only_where_its_map_differs():
    """The stored variant is compared at each T where its map is not the pair's own:
    offsets on the sampled map only give T = 1 rows and no T = 0 rows."""
    from dataclasses import replace

    from treespark.spec.calibration import Calibration

    pair = random_pair(64, 0, block_size=3)
    pair = replace(pair, calibration=Calibration(1.0, 0.0, sampled=Calibration(0.5, 0.0, sibling_bias=(-1.0,))))
    variant = Calibration(1.0, 0.0, sampled=Calibration(0.5, 0.0))
    table = acceptance_benchmark(pair, n_prompts=2, max_tokens=8, temperatures=(0.0, 1.0), chain_lengths=[1],
                                 variant=variant, log=lambda *a: None)
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    named = [(c[0].strip("| "), c[1]) for c in rows if "(a, b) only" in c[1] or "sibling offsets" in c[1]]
    assert named and {t for t, _ in named} == {"1"}
    assert all("(a, b) only" in name for _, name in named)

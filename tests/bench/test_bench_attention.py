"""``treespark bench attention`` runs at the contexts it names, up to the model's own
longest (its trees' positions past it, as an engine's rotary table holds them)."""

from __future__ import annotations

from treespark.bench.attention import attention_table


def test_the_attention_table_runs_at_the_models_longest_context(pair64):
    longest = pair64.target.config.max_position_embeddings
    table = attention_table(pair64, batch=1, long_context=longest, nodes=4, repeats=1)
    assert f"1 x {longest}" in table and "verify forward" in table and "drafter block" in table

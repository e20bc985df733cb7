"""`treespark bench rounds --host`: whole decode steps of a batch, their host time and copies."""

from treespark.bench.host_steps import batch_engine, host_benchmark, host_budget, measure
from treespark.bench.sides import ROOT
from treespark.models.pair import random_pair


def test_the_batch_engine_decodes_a_full_batch_of_trees():
    pair = random_pair(128, 0, block_size=3, markov_rank=8)
    eng = batch_engine(pair, 3, 1.0, 2)
    assert eng.num_running == 3 and eng.num_waiting == 0
    eng.set_budget(host_budget())
    stats = []
    eng.on_step = stats.append
    for _ in range(2):
        eng.step()
    for s in stats:
        assert s.batch_size == 3 and s.draft_waves > 0 and sum(s.tree_sizes) > 3
        assert s.host_syncs == s.draft_waves + 1   # a wave each, verification: nothing else in a pure decode step
        assert s.host_uploads == s.draft_waves + 6  # backbone, waves, trees (2), walk (2), commit


def test_a_side_measures_host_time_inside_its_wall_time():
    m = measure(vocab_size=128, markov_rank=8, block_size=3, family="qwen3", draft_vocab=0, batch=2,
                temperature=0.0, steps=1)
    assert 0 < m["host_ms"] < m["wall_ms"] and m["cpu_ms"] > 0 and m["ops"] > 100
    assert m["nodes"] > 2 and m["syncs"] >= 1 and m["uploads"] >= 1


def test_the_table_sets_the_sides_beside_each_other():
    lines: list[str] = []
    table = host_benchmark(vocab_size=128, markov_rank=8, block_size=3, batch_sizes=(2,), temperatures=(1.0,),
                           steps=1, base=ROOT, log=lines.append)
    body = [r.split("|")[1:4] for r in table.splitlines() if r.startswith("|")][2:]
    assert [c[2].strip() for c in body] == ["before", "after", "after / before"] and len(lines) == 3
    assert all(c[:2] == [" 2 ", " 1 "] for c in body)

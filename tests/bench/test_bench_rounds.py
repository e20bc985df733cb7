"""`treespark bench rounds --host`: whole decode steps of a batch, with their copies."""

from treespark.bench.rounds import batch_steps, host_benchmark
from treespark.models.pair import random_pair


def test_batch_steps_run_full_batches_of_trees():
    pair = random_pair(128, 0, block_size=3, markov_rank=8)
    cpu: list[float] = []
    stats = batch_steps(pair, 3, 1.0, 2, cpu_s=cpu)
    assert len(stats) == len(cpu) == 2 and all(c > 0 for c in cpu)
    for s in stats:
        assert s.batch_size == 3 and s.draft_waves > 0 and sum(s.tree_sizes) > 3
        assert s.host_syncs == s.draft_waves + 1   # a wave each, verification: nothing else in a pure decode step
        assert s.host_uploads == s.draft_waves + 6  # backbone, waves, trees (2), walk (2), commit


def test_the_host_table_has_a_row_per_batch_and_temperature():
    lines: list[str] = []
    table = host_benchmark(vocab_size=128, markov_rank=8, block_size=3, batch_sizes=(1, 2), steps=1,
                           log=lines.append)
    body = [r for r in table.splitlines() if r.startswith("|")][2:]
    assert len(body) == len(lines) == 4
    assert [r.split("|")[1:3] for r in body] == [[" 1 ", " 0 "], [" 1 ", " 1 "], [" 2 ", " 0 "], [" 2 ", " 1 "]]

"""`treespark bench engine`: every decoder side by side, per-step against the best fixed."""

from treespark.bench.engine_bench import PER_STEP, engine_benchmark, fixed_budgets
from treespark.models.pair import random_pair


def test_every_decoder_runs_each_pass_in_alternating_order_and_per_step_is_rated_against_the_best_fixed(tmp_path):
    pair = random_pair(64, 0, block_size=3)
    lines: list[str] = []
    table = engine_benchmark(pair, batch_sizes=(1, 2), max_tokens=6, chains=(2,), batches=2, repeats=2,
                             cost_cache=tmp_path, profile_s=2.0, log=lines.append)
    names = [*fixed_budgets((2,)), PER_STEP]
    # bs=1: a pass in the configs' order, then one reversed; bs=2 the same
    order = [ln.split(":")[0].split()[-1] for ln in lines if ln.startswith("bs= 1")]
    assert order == names + names[::-1]
    assert sum(ln.startswith("bs= 2") for ln in lines) == 2 * len(names)
    head, _, *body = [r for r in table.splitlines() if r.startswith("|")]
    assert head.split("|")[2:-1] == [f" {n} " for n in names] + [" per-step / best fixed "]
    for row in body:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        rate = {n: float(c.split()[0]) for n, c in zip(names, cells[1:-1], strict=True)}
        ratio, best = cells[-1].split()
        assert best.strip("()") == max((n for n in names if n != PER_STEP), key=rate.__getitem__)
        assert abs(float(ratio) - rate[PER_STEP] / rate[best.strip("()")]) < 0.02
    assert list(tmp_path.glob("*.json")), "the startup table is cached where asked"


def test_without_per_step_no_table_is_measured(tmp_path):
    pair = random_pair(64, 0, block_size=3)
    table = engine_benchmark(pair, batch_sizes=(1,), max_tokens=4, chains=(2,), per_step=False,
                             cost_cache=tmp_path, log=lambda _: None)
    assert "per-step" not in table and not list(tmp_path.iterdir())

"""The online correction of a step-cost table (treespark.pricing.costfit): pure numpy,
then its engine side (``StepAllocator.observe``) on a real engine."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from treespark.pricing.allocate import StepCosts, allocate
from treespark.pricing.costfit import CostFit, guard, node_bin, predict_step, served_ratios
from treespark.pricing.costmodel import CostModel

DRAFT = CostModel.affine(0.004, 0.0003)     # drafting: 4 ms + 0.3 ms a row and node of cap
TABLE = StepCosts(CostModel.affine(0.02, 0.002), node_s=0.0002, max_nodes=16, draft=DRAFT)


def run_steps(fit: CostFit, true: StepCosts, n: int, rng: np.random.Generator, *, draft: bool = True,
              noise: float = 0.02) -> None:
    """``n`` steps of random shapes whose measured stage seconds follow ``true``."""
    for _ in range(n):
        bs = int(rng.integers(1, 9))
        sizes = tuple(int(x) for x in rng.integers(0, 9, bs)) if draft else (0,) * bs
        cap = 1 + max(sizes) + int(rng.integers(0, 8)) if draft else 0
        p = predict_step(TABLE, bs, cap, sizes)
        t = predict_step(true, bs, cap, sizes)
        e = 1 + noise * rng.standard_normal(2)
        fit.observe(p, t.draft * e[0], (t.base + t.extra) * e[1], rows=bs, nodes=sum(sizes))


def test_a_uniform_slowdown_is_learnt_and_changes_no_allocation():
    fit, rng = CostFit(), np.random.default_rng(0)
    slow = StepCosts(CostModel.affine(0.03, 0.003), node_s=0.0003, max_nodes=16,
                     draft=CostModel.affine(0.006, 0.00045))   # everything x 1.5
    run_steps(fit, slow, 400, rng)
    base, extra = fit.verify_factors()
    assert fit.draft == pytest.approx(1.5, rel=0.03)
    assert base == pytest.approx(1.5, rel=0.03) and extra == pytest.approx(1.5, rel=0.03)
    fixed = fit.corrected(TABLE)
    assert fixed.verify_row(4) == pytest.approx(slow.verify_row(4), rel=0.03)
    scores = [list(np.linspace(0.9, 0.1, 12)), list(np.linspace(0.6, 0.05, 12))]
    assert allocate(scores, fixed).counts == allocate(scores, TABLE).counts


def test_dearer_verified_tokens_are_learnt_and_cut_the_trees():
    """In service every verified token costs 3x the table's, the fixed part 1.2x: the fit
    finds both, and the corrected table verifies fewer nodes."""
    fit, rng = CostFit(), np.random.default_rng(1)
    true = replace(TABLE, base_scale=1.2, extra_scale=3.0, node_s=3 * TABLE.node_s)
    run_steps(fit, true, 600, rng)
    base, extra = fit.verify_factors()
    assert base == pytest.approx(1.2, rel=0.05) and extra == pytest.approx(3.0, rel=0.05) and fit.draft == pytest.approx(1.0, rel=0.03)
    scores = [list(np.linspace(0.9, 0.2, 16)) for _ in range(4)]
    assert allocate(scores, fit.corrected(TABLE)).nodes < allocate(scores, TABLE).nodes


def test_plain_steps_alone_move_both_verify_factors_together():
    fit, rng = CostFit(), np.random.default_rng(2)
    slow = StepCosts(CostModel.affine(0.026, 0.0026), node_s=0.00026, max_nodes=16)   # x 1.3
    run_steps(fit, slow, 300, rng, draft=False)
    base, extra = fit.verify_factors()
    assert base == pytest.approx(1.3, rel=0.03) and extra == pytest.approx(base, rel=0.02)
    assert fit.draft == 1.0            # no drafting step: the table's drafting stands


def test_no_steps_leave_the_table_and_one_stall_does_not_set_the_price():
    fit = CostFit()
    assert fit.draft == 1.0 and fit.verify_factors() == pytest.approx((1.0, 1.0))
    same = fit.corrected(TABLE)
    assert same.verify_row(3) == pytest.approx(TABLE.verify_row(3)) and same.drafting_s(4, 8) == TABLE.drafting_s(4, 8)
    run_steps(fit, TABLE, 200, np.random.default_rng(3))
    p = predict_step(TABLE, 4, 8, (3, 3, 2, 4))
    fit.observe(p, 100 * p.draft, 100 * (p.base + p.extra))     # a 100x stall (a GC pause, a preemption)
    base, extra = fit.verify_factors()
    assert fit.draft < 1.1 and base < 1.1 and extra < 1.2


def test_guard_uses_a_factor_only_on_enough_samples_and_within_its_bound():
    assert guard(2.0, 15.9, min_samples=16, bound=4) == 1.0
    assert guard(2.0, 16.0, min_samples=16, bound=4) == 2.0
    assert guard(9.0, 100, min_samples=16, bound=4) == 4.0 and guard(0.1, 100, min_samples=16, bound=4) == 0.25
    assert guard(float("nan"), 100, min_samples=16, bound=4) == 1.0
    assert [node_bin(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32)] == [0, 1, 2, 2, 4, 4, 8, 16, 32]


def test_too_few_steps_leave_the_table():
    """A few steps twice the table move the raw fit, not the table priced on."""
    fit, rng = CostFit(), np.random.default_rng(4)
    twice = replace(TABLE, base_scale=2.0, extra_scale=2.0, node_s=2 * TABLE.node_s, draft_scale=2.0)
    run_steps(fit, twice, 8, rng)
    assert fit.verify_factors()[0] > 1.3
    f = fit.factors()
    assert (f.draft, f.base, f.extra, f.rows) == (1.0, 1.0, 1.0, {})
    assert fit.corrected(TABLE).verify_row(4) == pytest.approx(TABLE.verify_row(4))
    run_steps(fit, twice, 200, rng)
    assert fit.factors().base == pytest.approx(2.0, rel=0.05)


def test_the_fit_follows_drift():
    """1.5x the table for 400 steps, then the table again: the correction comes back."""
    fit, rng = CostFit(), np.random.default_rng(5)
    slow = replace(TABLE, base_scale=1.5, extra_scale=1.5, node_s=1.5 * TABLE.node_s)
    run_steps(fit, slow, 400, rng, draft=False)
    assert fit.factors().base == pytest.approx(1.5, rel=0.03)
    run_steps(fit, TABLE, 400, rng, draft=False)
    f = fit.factors()
    assert f.base == pytest.approx(1.0, rel=0.03) and f.extra == pytest.approx(1.0, rel=0.05)
    assert all(r == pytest.approx(1.0, rel=0.05) for r in f.rows.values())


def test_one_row_count_dearer_than_its_cell_is_corrected_there_alone():
    """The table's 4-row forward was timed in a quiet moment: steps of 4 rows take twice
    what it says, every other row count as it says. Only rows[4] moves; a row count seen
    too rarely keeps the factors alone."""
    fit, rng = CostFit(), np.random.default_rng(6)
    rows4 = replace(TABLE, row_scale={4: 2.0})
    run_steps(fit, rows4, 2000, rng, draft=False)
    f = fit.factors()
    assert f.rows[4] == pytest.approx(2.0 / f.base, rel=0.05)
    corrected = fit.corrected(TABLE)
    for bs in (1, 2, 4, 7):
        assert corrected.verify_row(bs)[0] == pytest.approx(rows4.verify_row(bs)[0], rel=0.06)
    # 12 rows: 5 steps, below min_samples: no residual of its own
    for _ in range(5):
        p = predict_step(TABLE, 12, 0, (0,) * 12)
        fit.observe(p, 0.0, 3 * p.base, rows=12)
    assert 12 not in fit.factors().rows


def test_cells_show_the_table_the_correction_and_the_clock():
    fit, rng = CostFit(), np.random.default_rng(7)
    slow = replace(TABLE, base_scale=1.5, extra_scale=1.5, node_s=1.5 * TABLE.node_s,
                   draft_scale=1.5)
    run_steps(fit, slow, 800, rng, noise=0.0)
    cells = fit.cells()
    assert {(c.rows, c.nodes) for c in cells} <= {(bs, node_bin(n)) for bs in range(1, 9) for n in range(65)}
    assert sum(c.steps for c in cells) == pytest.approx(sum(fit.cell_decay ** k for k in range(800)), rel=1e-6)
    for c in cells:
        assert c.measured_s == pytest.approx(1.5 * c.table_s, rel=0.02)
        assert c.corrected_s == pytest.approx(c.measured_s, rel=0.03)
    corrected, measured = served_ratios(cells)
    assert corrected == pytest.approx(1.5, rel=0.03) and measured == pytest.approx(1.5, rel=0.02)
    assert served_ratios([]) is None


def test_prediction_splits_the_table():
    p = predict_step(TABLE, 2, 8, (4, 1))
    row = TABLE.verify_row(2)
    assert p.draft == pytest.approx(0.004 + 0.0003 * 2 * 8)     # by rows and the node cap, not the nodes
    assert p.base == pytest.approx(row[0]) and p.extra == pytest.approx(row[4] - row[0] + 0.0002 * 5)
    assert predict_step(TABLE, 2, 0, (0, 0)) == type(p)(0.0, row[0], 0.0)


def test_the_engine_feeds_the_fit_and_prices_on_the_corrected_table(mimic16):
    """Every decode step reaches the fit; ``costs`` becomes the corrected table every
    ``refit_every`` steps, while ``table`` stays as measured; greedy output is unchanged."""
    from treespark.engine.config import EngineConfig
    from treespark.engine.core import Engine
    from treespark.engine.step_alloc import StepAllocator
    from treespark.spec.budget import Budget
    from treespark.spec.params import SamplingParams

    table = StepCosts(CostModel.affine(1e-5, 1e-7), max_nodes=16)     # far cheaper than this CPU
    cfg = EngineConfig(max_batch_size=4, max_context=128)
    prompts = [[1 + (i * 5 + j) % 15 for j in range(12)] for i in range(4)]
    outs = {}
    for name, fit in (("plain", None), ("fit", CostFit(min_samples=4))):
        engine = Engine(mimic16, cfg, budget=Budget.off() if fit is None else Budget(0.0, 16, 4))
        if fit is not None:
            alloc = StepAllocator(table, fit=fit, refit_every=4)
            engine.set_allocator(alloc)
        steps = []
        engine.on_step = steps.append
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs[name] = got
    decode = [s for s in steps if s.prefill_tokens == 0 or s.batch_size > 0]
    assert outs["fit"] == outs["plain"]
    assert alloc.fit.steps == len([s for s in decode if s.batch_size > 0])
    assert alloc.table is table and alloc.costs is not table
    # a real forward is far dearer than 10 us, but no correction moves the table past its bound
    assert alloc.fit.verify_factors()[0] > 10 and alloc.costs.base_scale == alloc.fit.bound

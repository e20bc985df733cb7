"""The startup step-cost table (treespark.engine.step_costs): measured, cached by fingerprint."""

from __future__ import annotations

import time

import pytest
import torch

from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.step_costs import (
    StepCostTable,
    fingerprint,
    measure_verify,
    startup_step_costs,
    with_step_work,
)
from treespark.kernels.linear import F_LINEAR, SMALL, ProductPlan
from treespark.pricing.costmodel import CostModel
from treespark.spec.params import SamplingParams


def small_engine(pair):
    return Engine(pair, EngineConfig(max_batch_size=4, max_context=96, max_tree_nodes=8))


def test_measured_once_then_read_from_the_cache(pair64, tmp_path):
    engine = small_engine(pair64)
    first = startup_step_costs(engine, time_budget_s=20, cache_dir=tmp_path)
    assert first.source == "measured" and first.measured_s > 0
    v = first.verify
    assert v.batch_sizes == (1, 2, 4) and v.tokens == (1, 2, 3, 4, 6, 8, 9)  # dense at few tokens
    assert all(t > 0 for row in v.seconds for t in row)
    d = first.draft
    assert d.batch_sizes == (1, 4) and d.tokens == (1, 2, 4, 8)       # every cap up to the engine's largest
    assert all(t > 0 for row in d.seconds for t in row)                # drafting is not free
    assert all(a <= b for row in d.seconds for a, b in zip(row, row[1:], strict=False))   # nor cheaper at a larger cap
    assert first.host_node_s >= 0
    assert min(first.step_base_s, first.step_row_s) >= 0
    assert first.step_base_s + first.step_row_s > 0      # a step is more than its forward
    again = startup_step_costs(small_engine(pair64), time_budget_s=20, cache_dir=tmp_path)
    assert again.source == "cache" and again.fingerprint == first.fingerprint
    assert again.verify == first.verify
    assert StepCostTable.from_json(first.to_json()) == first
    costs = first.step_costs(max_nodes=8)
    assert costs.verify_row(2).shape == (9,)
    # the engine is left as it was: no synthetic request, steps as usual
    assert not engine.has_unfinished()
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()


def test_the_drafting_timings_come_from_steps_that_draft_to_full_depth(pair64):
    """A request's last steps draft under a depth limit cut by its tokens left: shallow,
    cheap trees that priced a served step's drafting at half. Every step the table times
    drafts each row to its node cap or the drafter's block."""
    from treespark.engine.step_costs import measure_drafting

    engine = small_engine(pair64)
    verify = measure_verify(engine, (1, 2, 4), (1, 2, 3, 4, 6, 8, 9), deadline=time.perf_counter() + 5)
    block = engine.drafter.config.block_size
    limits: list[tuple[int, int]] = []
    draft = engine.waves.draft

    def spy(base, rows):
        limits.extend((r.depth_limit, min(block, r.budget.node_cap)) for r in rows if not r.budget.is_off)
        return draft(base, rows)

    engine.waves.draft = spy
    m = measure_drafting(engine, verify, deadline=time.perf_counter() + 30)
    assert m.draft is not None and limits
    assert all(limit == full for limit, full in limits)
    assert not engine.has_unfinished()


def test_a_one_row_engines_table_prices_its_steps_work_too(pair64):
    """One row: no second batch size to split the step's work by rows, so it is the
    row's, added to every cell (without it, a bench's one-row table read a plain step
    cheaper than it is and every drafted node dearer)."""
    engine = Engine(pair64, EngineConfig(max_batch_size=1, max_context=96, max_tree_nodes=8))
    table = startup_step_costs(engine, time_budget_s=6, cache_dir=None)
    assert table.verify.batch_sizes == (1,) and table.draft.batch_sizes == (1,)
    assert table.step_base_s > 0 and table.step_row_s == 0.0


def test_other_threads_or_batch_sizes_are_another_fingerprint(pair64):
    engine = small_engine(pair64)
    grid = ((1, 2, 4), (1, 2, 4, 8, 9))
    fp = fingerprint(engine, grid)
    assert fp == fingerprint(small_engine(pair64), grid)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if n > 1 else 2)
        assert fingerprint(engine, grid) != fp
    finally:
        torch.set_num_threads(n)
    bigger = Engine(pair64, EngineConfig(max_batch_size=8, max_context=96, max_tree_nodes=8))
    assert fingerprint(bigger, grid) != fp
    compiled = Engine(pair64, EngineConfig(max_batch_size=4, max_context=96, max_tree_nodes=8,
                                           compile_backend="inductor"))
    assert fingerprint(compiled, grid) != fp  # a compiled forward's steps cost something else


def test_another_product_plan_is_another_fingerprint(pair64):
    """A table timed with one product layout does not price steps run in another."""
    cfg = EngineConfig(max_batch_size=4, max_context=96, max_tree_nodes=8)
    grid = ((1, 2, 4), (1, 2, 4, 8, 9))
    plans = [ProductPlan.fixed(F_LINEAR), ProductPlan.fixed(SMALL), ProductPlan((2, 4), (F_LINEAR, SMALL))]
    fps = {fingerprint(Engine(pair64, cfg, products=p), grid) for p in plans}
    assert len(fps) == 3
    assert fingerprint(Engine(pair64, cfg, products=ProductPlan.fixed(SMALL)), grid) in fps


def test_the_replica_factory_installs_the_allocation_for_perstep():
    from deployments.config import AppArgs
    from deployments.replica.engine_factory import build_engine

    args = AppArgs(model="random", vocab_size=64, max_batch_size=2, max_context=64, max_tree_nodes=8,
                   policy={"kind": "perstep", "max_nodes": 8, "profile_s": 10, "cost_cache": False})
    bundle = build_engine(args)
    assert bundle.engine.allocator is not None and bundle.step_costs["source"] == "measured"
    assert bundle.step_costs["measured_s"] > 0 and StepCostTable.from_json(bundle.step_costs["table"])
    ladder = build_engine(AppArgs(model="random", vocab_size=64, max_batch_size=2, max_context=64,
                                   policy={"kind": "ladder"}))
    assert ladder.engine.allocator is None and ladder.step_costs is None


def test_one_slow_timing_is_pooled_not_carried_to_every_larger_cell():
    from treespark.engine.step_costs import isotonic

    assert isotonic([1.0, 5.0, 2.0, 3.0, 4.0]) == [1.0, 10 / 3, 10 / 3, 10 / 3, 4.0]
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_the_drafting_fit_follows_the_faster_steps_not_a_neighbours_bursts():
    """Steps slowed by another process (a third of them, by 5-15 ms) move a least-squares
    fit; ``lower_fit`` keeps the steps' own costs."""
    import numpy as np

    from treespark.engine.step_costs import lower_fit

    gen = np.random.default_rng(0)
    bs = gen.choice([1, 4, 16], size=90)
    nodes = gen.integers(0, 17, size=90) * bs
    x = np.stack([np.ones(90), bs, nodes], axis=1).astype(float)
    own = x @ np.array([8e-3, 0.7e-3, 0.05e-3])
    y = own + gen.uniform(0, 0.2e-3, size=90)                      # timer jitter
    slowed = gen.random(90) < 1 / 3
    y = y + slowed * gen.uniform(5e-3, 15e-3, size=90)
    plain, *_ = np.linalg.lstsq(x, y, rcond=None)
    fit = lower_fit(x, y)
    assert abs(plain[0] - 8e-3) > 2e-3                              # the bursts move a plain fit
    assert abs(fit[0] - 8e-3) < 0.6e-3 and abs(fit[1] - 0.7e-3) < 0.1e-3 and abs(fit[2] - 0.05e-3) < 0.02e-3
    assert np.allclose(lower_fit(x, own), [8e-3, 0.7e-3, 0.05e-3])  # exact steps: their costs


def test_a_steps_fixed_work_is_added_to_every_cell():
    forward = CostModel((1, 4), (1, 2), ((0.010, 0.012), (0.020, 0.030)))
    step = with_step_work(forward, 0.004, 0.001)
    assert [list(r) for r in step.seconds] == [pytest.approx([0.015, 0.017]), pytest.approx([0.028, 0.038])]
    assert step.batch_sizes == forward.batch_sizes and step.tokens == forward.tokens


def test_the_timed_forwards_leave_the_requests_blocks_alone(pair64):
    """The verify cells are timed over the paged store, on blocks no request holds and
    the prefix cache does not keep: a running request's keys and values, and a finished
    one's cached blocks, are the same after."""
    engine = small_engine(pair64)
    engine.add_request("done", [1 + i % 60 for i in range(39)], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("running", [3 + i % 50 for i in range(20)], SamplingParams(max_tokens=30))
    for _ in range(3):
        engine.step()
    pool = engine.kv.pool
    kept = [b for b in range(1, pool.num_blocks) if pool.ref[b] > 0 or pool.key[b] is not None]
    assert kept and any(pool.key[b] is not None for b in kept) and any(pool.ref[b] > 0 for b in kept)
    bs = engine.kv.block_size
    slots = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in kept])
    before = engine.kv.target.k[:, slots].clone(), engine.kv.target.v[:, slots].clone()
    written = engine.kv.target.k.clone()
    measure_verify(engine, (1, 4), (1, 4, 9), deadline=time.perf_counter() - 1, context=32)
    assert torch.equal(engine.kv.target.k[:, slots], before[0]) and torch.equal(engine.kv.target.v[:, slots], before[1])
    assert not torch.equal(engine.kv.target.k, written)          # it wrote elsewhere
    while engine.has_unfinished():
        engine.step()


def test_another_kernel_build_is_another_fingerprint(pair64, monkeypatch):
    """A table timed on one build of the native kernels does not price steps run on another
    (a changed gemv.c or blocks.c)."""
    from treespark.kernels import native

    if native.library() is None:
        pytest.skip("no C compiler built the native kernels")
    engine = small_engine(pair64)
    grid = ((1, 2), (1, 2, 4))
    fp = fingerprint(engine, grid)
    monkeypatch.setattr(native, "build_id", lambda: "gemv-0000000000000000")
    assert fingerprint(engine, grid) != fp

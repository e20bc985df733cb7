"""The per-step allocation's argmax in one native call (``treespark.kernels.best``): the
numpy reference's candidates, ranking, pad, take and goodput, to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from treespark.engine.step_alloc import engine_best, native_best
from treespark.kernels.native import library
from treespark.pricing.allocate import StepCosts, allocate, best_allocation, plan_drafting
from treespark.pricing.costmodel import CostModel

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the native kernels are not built")


def _costs(rng: np.random.Generator, max_nodes: int) -> StepCosts:
    """A verify table that is flat, then rises, with kinks (as CPU forwards are), and a
    drafting table by rows and node cap."""
    tokens = (1, 2, 3, 5, 9, 17, 33, 65)
    bss = (1, 2, 4, 8, 16)
    base = rng.uniform(0.005, 0.03)
    verify = tuple(tuple(base * (1 + 0.1 * b) + rng.uniform(0, 0.002) * max(0, k - 4) * b for k in tokens) for b in bss)
    fixed = rng.uniform(0.001, 0.03)
    draft = tuple(tuple(fixed + rng.uniform(0, 3e-4) * k * b for k in tokens) for b in bss)
    return StepCosts(CostModel(bss, tokens, verify), node_s=float(rng.choice([0.0, 2e-5])), max_nodes=max_nodes,
                     draft=CostModel(bss, tokens, draft))


def _scores(rng: np.random.Generator, bs: int, max_nodes: int) -> list[list[float]]:
    """Rows of candidates, some empty, some longer than max_nodes, with tied scores (the
    ranking's ties go to the lower row, then the lower index) and scores near theta."""
    out = []
    for _ in range(bs):
        n = int(rng.integers(0, max_nodes + 4))
        s = rng.choice([0.9, 0.5, 0.5, 0.3, 0.1, 0.05, 0.02, 1e-13], n) if rng.random() < 0.4 else rng.uniform(0, 1, n) ** 2
        out.append(s.tolist())
    return out


def test_the_native_argmax_is_the_numpy_one_to_the_bit():
    rng = np.random.default_rng(0)
    cases = taken = 0
    for _ in range(400):
        max_nodes = int(rng.choice([4, 8, 32]))
        costs = _costs(rng, max_nodes)
        bs = int(rng.choice([1, 1, 2, 3, 8, 16]))
        scores = _scores(rng, bs, max_nodes)
        theta = float(rng.choice([0.0, 0.0, 0.05, 0.3]))
        ahead = bool(rng.random() < 0.5)
        draft_s = 0.0 if ahead else float(rng.uniform(0, 0.01))
        ref = best_allocation(scores, costs, draft_s, theta, ahead)
        got = native_best(scores, costs, draft_s, theta, ahead)
        assert np.array_equal(got.rows, ref.rows) and np.array_equal(got.scores, ref.scores)
        assert (got.pad, got.take, got.goodput, got.plain) == (ref.pad, ref.take, ref.goodput, ref.plain)
        cases += 1
        taken += ref.take > 0
    assert taken > 100 and cases - taken > 50   # both drafting and plain decoding won often


def test_allocate_and_plan_take_the_native_argmax():
    rng = np.random.default_rng(1)
    costs = _costs(rng, 16)
    scores = _scores(rng, 4, 16)
    assert engine_best() is native_best
    assert allocate(scores, costs, draft_s=0.003, best=native_best) == allocate(scores, costs, draft_s=0.003)
    assert plan_drafting(scores, costs, best=native_best) == plan_drafting(scores, costs)

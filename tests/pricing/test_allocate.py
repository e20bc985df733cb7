"""The per-step allocation (treespark.pricing.allocate): pure numpy, no model."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from treespark.pricing.allocate import StepCosts, allocate, plan_drafting, step_goodput
from treespark.pricing.costmodel import CostModel

ROOT = Path(__file__).resolve().parents[2]
CPU = CostModel.load(ROOT / "configs/costmodel-smollm2-2threads.json")
# drafting of the shipped drafter by (rows, node cap), as timed here (two-core EPYC, real prompts)
DRAFT_CPU = CostModel((1, 4, 16), (1, 2, 4, 8, 16, 32),
                      ((0.0035, 0.0044, 0.0057, 0.0057, 0.0069, 0.0100),
                       (0.0104, 0.0106, 0.0119, 0.0119, 0.0161, 0.0185),
                       (0.0217, 0.0243, 0.0278, 0.0291, 0.0358, 0.0443)))


def tree_scores(rng: np.random.Generator, n: int, lo: float = 0.2, hi: float = 1.0) -> list[float]:
    """Scores in node order of a random tree: each node's score at most its parent's."""
    scores, parents = [1.0], [-1]
    for _ in range(n):
        p = int(rng.integers(0, len(scores)))
        scores.append(scores[p] * float(rng.uniform(lo, hi)))
        parents.append(p)
    return scores[1:]


def brute_force(scores, costs, draft_s):
    """The best goodput over every per-row node count (each row's top nodes)."""
    best = 0.0
    for counts in itertools.product(*[range(len(s) + 1) for s in scores]):
        best = max(best, step_goodput(scores, counts, costs, draft_s))
    return best


@pytest.mark.parametrize("cost", [CPU, CostModel.affine(0.02, 0.002)], ids=["cpu-table", "affine"])
def test_greedy_rows_get_the_optimum_over_all_node_counts(cost):
    rng = np.random.default_rng(0)
    costs = StepCosts(cost, node_s=0.0005, max_nodes=8)
    for _ in range(60):
        bs = int(rng.integers(1, 4))
        scores = [tree_scores(rng, int(rng.integers(0, 6))) for _ in range(bs)]
        draft_s = float(rng.uniform(0, 0.03))
        a = allocate(scores, costs, draft_s=draft_s)
        assert a.goodput == pytest.approx(brute_force(scores, costs, draft_s), rel=1e-12)
        assert all(0 <= c <= len(s) for c, s in zip(a.counts, scores, strict=True))


def test_trees_shrink_to_chains_then_plain_as_the_batch_grows():
    """On the measured 2-thread CPU table, with drafting priced (about what the shipped
    drafter costs here): wide trees alone, a few nodes at batch 4, plain from 8."""
    rng = np.random.default_rng(1)
    costs = StepCosts(CPU, max_nodes=32, draft=DRAFT_CPU)
    tree = tree_scores(rng, 32, 0.1, 0.8)     # about the shipped drafter's acceptance
    pads = {bs: plan_drafting([tree] * bs, costs).pad for bs in (1, 2, 4, 8, 16)}
    assert pads[1] >= 8 and pads[1] > pads[2] > pads[4] >= 1 and pads[8] == pads[16] == 0
    # once drafted (its cost spent), verifying still shrinks with the batch
    per_row = {bs: allocate([tree] * bs, costs, draft_s=costs.drafting_s(bs, 32)).nodes / bs for bs in (1, 4, 16)}
    assert per_row[1] > per_row[4] >= per_row[16]


def test_the_floor_price_bounds_every_taken_node():
    rng = np.random.default_rng(2)
    costs = StepCosts(CostModel.affine(0.05, 1e-6), max_nodes=16)   # verification nearly free
    scores = [tree_scores(rng, 16) for _ in range(4)]
    free = allocate(scores, costs)
    assert free.counts == tuple(len(s) for s in scores)              # everything pays
    priced = allocate(scores, costs, theta=0.3)
    for s, c in zip(scores, priced.counts, strict=True):
        assert c == sum(x >= 0.3 for x in s)
    assert allocate(scores, costs, theta=1.0).nodes == 0


def test_expensive_verification_means_plain_decoding():
    scores = [[0.5, 0.25], [0.4]]
    a = allocate(scores, StepCosts(CostModel.affine(0.01, 1.0), max_nodes=4))
    assert a.counts == (0, 0) and math.isinf(a.theta) and a.goodput == pytest.approx(a.plain_goodput)


def test_a_sampled_row_is_cut_by_a_price_its_own_draws_cannot_move():
    """A T > 0 row is priced through its proxy (the step before): changing its current
    scores changes how many of them clear the price, never the price."""
    rng = np.random.default_rng(3)
    costs = StepCosts(CPU, max_nodes=16)
    others = [tree_scores(rng, 12) for _ in range(3)]
    proxy = tree_scores(rng, 12)
    thetas, pads = set(), set()
    for _ in range(20):
        mine = tree_scores(rng, int(rng.integers(0, 16)))
        a = allocate([mine, *others], costs, draft_s=0.01, sampled=[True, False, False, False],
                     proxies=[proxy, None, None, None])
        thetas.add(a.theta)
        assert a.counts[0] == min(sum(x >= a.theta for x in mine), max(a.counts[1:] + (a.counts[0],)))
        pads.add(a.counts[1:])
    assert len(thetas) == 1 and len(pads) == 1
    # without a proxy the row does not enter the argmax; with no candidates anywhere to
    # price against, the drafting budget (its theta) decides
    alone = allocate([[0.9, 0.5, 0.1]], costs, sampled=[True], proxies=[None], theta=0.2)
    assert alone.counts == (2,)


def test_a_full_batch_verifies_part_of_its_candidates():
    """16 rows of 32 candidates on the CPU table: some nodes pay, not all."""
    rng = np.random.default_rng(4)
    costs = StepCosts(CPU, max_nodes=32)
    scores = [tree_scores(rng, 32) for _ in range(16)]
    a = allocate(scores, costs, draft_s=0.05)
    assert 0 < a.nodes < 16 * 32 and a.goodput > a.plain_goodput


def test_a_small_plan_is_priced_at_the_drafting_of_its_own_cap():
    """Drafting takes one wave at a cap of 1 and ~5 at 32: a small plan pays its own
    cap's. Priced at the large cap's (a cost linear in nodes fitted to large trees did
    about that: 6.1 ms a one-node draft against 3.5 measured), the same forecast plans
    plain decoding: the served default then decoded plain at one user."""
    # the served default's step table at one row (tokens 1 .. 8) and a forecast its trees gave
    verify = CostModel((1,), tuple(range(1, 9)), ((0.01738, 0.01789, 0.02069, 0.02069, 0.0275, 0.03432, 0.03804,
                                                    0.04176),))
    profile = [0.32, 0.15, 0.08, 0.06, 0.05, 0.04]
    by_cap = StepCosts(verify, max_nodes=32, draft=DRAFT_CPU)
    flat = StepCosts(verify, max_nodes=32, draft=CostModel((1,), (1,), ((DRAFT_CPU.time(1, 32),),)))
    plan = plan_drafting([profile], by_cap)
    assert plan.pad >= 1 and plan.goodput > plan.plain_goodput
    assert plan_drafting([profile], flat).pad == 0
    assert by_cap.drafting_s(1, 2) < by_cap.drafting_s(1, 32) and by_cap.drafting_s(1, 0) == 0.0

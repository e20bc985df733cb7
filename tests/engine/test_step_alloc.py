"""The per-step allocation in the engine (treespark.engine.step_alloc): exact at every
temperature, and it does cut the trees."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from tests.engine.test_engine import prompts, run
from tests.spec.test_exact import (
    CAL,
    Branch,
    ReplaySampler,
    TableProposal,
    draft_paths,
    target_dist,
    target_joint,
    tv,
)
from treespark import Budget
from treespark.engine import step_alloc
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.step_alloc import StepAllocator
from treespark.pricing.allocate import DraftPlan, StepCosts, allocate, best_prefix
from treespark.pricing.costmodel import CostModel
from treespark.spec.drafting import best_nodes, subtree
from treespark.spec.expand import open_on_host
from treespark.spec.params import SamplingParams
from treespark.spec.sampling import draft_probs
from treespark.spec.select import TreeBuilder
from treespark.spec.verify import verify_sampled

# verification costs a tenth of a forward per token: trees of a few nodes pay, not all
COSTS = StepCosts(CostModel.affine(0.01, 0.001), max_nodes=8)
BUDGET = Budget(theta=0.0, node_cap=4, branch_cap=2)
PROXY = [0.55, 0.4, 0.3, 0.2]        # a T > 0 row's candidates of the step before


def expand_scored(budget, temperature, sampler):
    """``treespark.spec.expand.expand`` that also returns each draft node's score."""
    cal, prop = CAL.at(temperature), TableProposal()
    b = TreeBuilder(0, budget, prop.max_depth)
    dists = {}
    while opens := b.to_open():
        for n in opens:
            q = draft_probs(prop.logits(b.token(n), b.nodes[n].depth + 1), temperature).to(torch.float64)
            dists[n] = q / q.sum()
            b.open(n, open_on_host(dists[n], budget.branch_cap, temperature, cal, sampler))
    tree, keep = b.finish()
    tree.child_q = {i: dists[c] for i, c in enumerate(keep) if tree.children[i]}
    return tree, [b.nodes[c].score for c in keep[1:]]


def enumerate_cut(temperature, count_of):
    """{first 3 tokens: probability} of one round whose tree is cut to ``count_of(tree,
    scores)`` best nodes, continued by exact target sampling (as ``test_exact``)."""
    dist, stack, cut_sizes = {}, [[]], set()
    while stack:
        script = stack.pop()
        s = ReplaySampler(script)
        try:
            tree, scores = expand_scored(BUDGET, temperature, s)
            tree = subtree(tree, best_nodes(scores, count_of(tree, scores)))
            cut_sizes.add(tree.size)
            paths = draft_paths(tree)
            out = verify_sampled(tree, torch.stack([target_dist(p, temperature) for p in paths]), s)
        except Branch as b:
            stack += [script + [o] for o, _ in b.options]
            continue
        tokens = tuple(out.tokens[:3])
        for tail in itertools.product(range(3), repeat=3 - len(tokens)):
            seq, prob = tokens + tail, s.prob
            for j in range(len(tokens), 3):
                prob *= float(target_dist(seq[:j], temperature)[seq[j]])
            dist[seq] = dist.get(seq, 0.0) + prob
    return dist, cut_sizes


@pytest.mark.parametrize("temperature", [pytest.param(0.5, marks=pytest.mark.slow), 1.0])
def test_a_sampled_row_cut_by_the_allocation_is_lossless(temperature):
    def count(tree, scores):
        return allocate([scores], COSTS, sampled=[True], proxies=[PROXY]).counts[0]

    dist, sizes = enumerate_cut(temperature, count)
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    assert tv(dist, target_joint(temperature)) < 1e-6
    assert len(sizes) > 1 and min(sizes) < BUDGET.node_cap   # the cut binds, and not always alike


def test_a_cut_that_looks_at_its_own_draws_would_be_lossy():
    """Why a T > 0 row is priced through history: the argmax over its own realized
    survivals (which depend on its draws) changes the output distribution."""
    def count(tree, scores):
        return best_prefix([tree.survival[1:]], COSTS).counts[0]

    dist, _ = enumerate_cut(1.0, count)
    assert tv(dist, target_joint(1.0)) > 1e-4


def engine_with_allocator(pair, cost, batch=4, budget=None):
    engine = Engine(pair, EngineConfig(max_batch_size=batch, max_context=128), budget=budget or Budget(0.0, 16, 4))
    engine.set_allocator(StepAllocator(StepCosts(cost, max_nodes=16)))
    return engine


@pytest.mark.parametrize("cost", [CostModel.affine(0.01, 0.0005), CostModel.affine(0.01, 0.004)],
                         ids=["cheap", "dear"])
def test_greedy_output_is_unchanged_and_trees_are_cut(mimic16, cost):
    ps = prompts(6, 16, seed=3)
    params = SamplingParams(max_tokens=24)
    plain, _ = run(Engine(mimic16, EngineConfig(max_batch_size=4, max_context=128), budget=Budget.off()),
                   {0: [(f"r{i}", p, params) for i, p in enumerate(ps)]})
    engine = engine_with_allocator(mimic16, cost)
    steps = []
    engine.on_step = steps.append
    out, _ = run(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(ps)]})
    assert out == plain
    drafted = [s for s in steps if s.draft_waves]
    assert drafted and all(s.policy_s > 0 for s in steps)
    assert max(max(s.tree_sizes) for s in drafted) < 16     # cut below what the budget drafts


def test_dearer_verification_verifies_fewer_nodes(mimic16):
    ps = prompts(4, 16, seed=5)
    params = SamplingParams(max_tokens=24)
    per_step = {}
    for name, cost in (("cheap", CostModel.affine(0.01, 0.0002)), ("dear", CostModel.affine(0.01, 0.02))):
        engine = engine_with_allocator(mimic16, cost)
        steps = []
        engine.on_step = steps.append
        run(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(ps)]})
        per_step[name] = sum(s.tokens_verified - s.batch_size for s in steps) / len(steps)
    assert per_step["cheap"] > 2 * per_step["dear"]


def test_sampled_rows_stay_seeded_and_complete(mimic16):
    """T > 0 under the allocation: each request finishes with its length, and a seeded
    batch replays identically."""
    ps = prompts(4, 16, seed=7)
    arrivals = {0: [(f"r{i}", p, SamplingParams(max_tokens=20, temperature=1.0, seed=i)) for i, p in enumerate(ps)]}
    a, reasons = run(engine_with_allocator(mimic16, CostModel.affine(0.01, 0.001)), arrivals)
    b, _ = run(engine_with_allocator(mimic16, CostModel.affine(0.01, 0.001)), arrivals)
    assert a == b and all(len(t) == 20 for t in a.values()) and set(reasons.values()) == {"length"}


def test_policy_time_counts_the_allocations_work_not_time_the_thread_waits(monkeypatch):
    """policy_s is CPU time: a call that waits (here a sleep standing in for the OS
    running another process) is charged its work only, not the wait."""
    def slow_plan(forecasts, costs, *, theta=0.0, best=None):
        time.sleep(0.05)
        return DraftPlan(2, 0.5, 1.0, 0.5)

    monkeypatch.setattr(step_alloc, "plan_drafting", slow_plan)
    alloc = StepAllocator(StepCosts(CostModel.affine(0.01, 0.0005), max_nodes=16))
    alloc._profile = [0.5] * 16
    t0 = time.perf_counter()
    budgets = alloc.drafting(["a", "b"], [Budget(0.0, 16, 4)] * 2, [True, True], 0.0)
    assert time.perf_counter() - t0 >= 0.05
    assert [b.node_cap for b in budgets] == [4, 4]           # twice the planned pad
    assert 0 < alloc.policy_s < 0.02


def test_probes_keep_their_cost_at_the_share_of_plain_decoding_at_every_batch():
    """Plain steps, nothing worth drafting: a probe drafts every row (4 nodes) as rarely as
    keeps its extra seconds at ``probe_share`` of plain decoding's, so at 16 rows, where a
    padded verify costs much more than a one-token one, probes are rarer than at one."""
    model = CostModel((1, 16), (1, 5), ((0.036, 0.044), (0.098, 0.255)))
    costs = StepCosts(model, max_nodes=8, draft=CostModel.affine(0.009, 0.0001))
    for bs in (1, 16):
        alloc = StepAllocator(costs)
        alloc._profile = [0.01] * 8                        # nothing pays: plain decoding planned
        ids = [str(i) for i in range(bs)]
        probes = []
        for step in range(1000):
            caps = [b.node_cap for b in alloc.drafting(ids, [Budget(0.0, 8, 4)] * bs, [True] * bs, 0.0)]
            assert len(set(caps)) == 1 and caps[0] in (0, 4)
            if caps[0]:
                probes.append(step)
        every = alloc.probe_every(bs)
        row = costs.verify_row(bs)
        extra = row[4] - row[0] + costs.drafting_s(bs, 4)
        assert probes and all(b - a == every for a, b in zip(probes, probes[1:], strict=False))
        assert extra / every <= alloc.probe_share * row[0] < extra / (every - 1)   # the rarest within the share
    assert StepAllocator(costs).probe_every(16) > 3 * StepAllocator(costs).probe_every(1)


def test_plain_steps_replan_nothing_until_the_profile_the_batch_or_the_price_moves(monkeypatch):
    calls = []

    def counted(forecasts, costs, *, theta=0.0, best=None):
        calls.append((len(forecasts), theta))
        return DraftPlan(0, float("inf"), 1.0, 1.0)

    monkeypatch.setattr(step_alloc, "plan_drafting", counted)
    alloc = StepAllocator(StepCosts(CostModel.affine(0.01, 0.0005), max_nodes=16))
    alloc._profile = [0.01] * 16
    for _ in range(10):
        alloc.drafting(["a", "b"], [Budget(0.0, 16, 4)] * 2, [True, True], 0.0)
    assert calls == [(2, 0.0)]
    alloc.drafting(["a"], [Budget(0.0, 16, 4)], [True], 0.0)              # another batch
    alloc.drafting(["a"], [Budget(0.0, 16, 4)], [True], 0.2)              # another price
    alloc._profile_version += 1                                           # the profile moved (``cut``)
    alloc.drafting(["a"], [Budget(0.0, 16, 4)], [True], 0.2)
    assert calls == [(2, 0.0), (1, 0.0), (1, 0.2), (1, 0.2)]


def chain_draft(scores: list[float]):
    """A one-row ``RoundDraft``: a chain whose nodes score ``scores``."""
    from treespark.spec.drafting import RoundDraft
    from treespark.spec.tree import DraftTree

    n = len(scores)
    tree = DraftTree(tokens=list(range(n + 1)), parents=[-1, *range(n)], depths=list(range(n + 1)),
                     q=[1.0, *scores], survival=[1.0, *scores], children=[[i + 1] for i in range(n)] + [[]])
    return RoundDraft(trees=[tree], q_row_of=[[-1] * (n + 1)], draft_ids=[list(range(n + 1))], scores=[list(scores)])


def test_a_probe_after_a_long_plain_run_renews_a_stale_forecast():
    """A forecast that plans plain decoding, then the traffic changes: the first probe's
    tree (one wave of drafting, seen ``probe_every`` plain steps later) is most of what
    the profile holds after it, so the next step drafts. Weighed as one drafted tree
    among ten, the stale forecast would keep the replica plain through probe after probe."""
    costs = StepCosts(CostModel.affine(0.01, 0.0005), max_nodes=8, draft=CostModel.affine(0.004, 0.0002))
    alloc = StepAllocator(costs)
    alloc._profile = [0.05] * 8
    budget = [Budget(0.0, 8, 4)]
    plain = 0
    while (cap := alloc.drafting(["a"], budget, [True], 0.0)[0].node_cap) == 0:
        plain += 1
    assert alloc.plan.pad == 0 and cap == step_alloc.PROBE_NODES and plain == alloc.probe_every(1) - 1
    alloc.cut(["a"], [0.0], [True], chain_draft([0.9, 0.8, 0.7, 0.6]), 0.0)
    assert alloc._profile[0] > 0.85 and alloc._profile[3] > 0.55
    assert alloc.drafting(["a"], budget, [True], 0.0)[0].node_cap >= 2 and alloc.plan.pad >= 1


def test_a_steps_rows_weigh_alike_in_the_forecast():
    """A probe of four rows after a long plain run: the forecast is the rows' mean by rank,
    whichever row comes first (blended one row after another, the first row's tree was
    ~0.7 of it), and rows that drafted nothing are not read as trees of zeros."""
    from treespark.spec.drafting import RoundDraft
    from treespark.spec.tree import DraftTree

    costs = StepCosts(CostModel.affine(0.01, 0.0005), max_nodes=4, draft=CostModel.affine(0.004, 0.0002))
    high, low = [0.9, 0.8, 0.7, 0.6], [0.1, 0.1, 0.1, 0.1]
    profiles = []
    for rows in ([high, low, low, low], [low, low, low, high], [low, [], high, low, low, []]):
        alloc = StepAllocator(costs)
        alloc._profile, alloc._aged = [0.5] * 4, 1000
        trees = [chain_draft(s) if s else None for s in rows]
        drafted = RoundDraft(trees=[t.trees[0] if t else DraftTree.root_only(0) for t in trees],
                             q_row_of=[t.q_row_of[0] if t else [-1] for t in trees],
                             draft_ids=[t.draft_ids[0] if t else [0] for t in trees], scores=[list(s) for s in rows])
        ids = [str(i) for i in range(len(rows))]
        alloc.cut(ids, [0.0] * len(rows), [True] * len(rows), drafted, 0.0)
        profiles.append(alloc._profile)
    want = [(h + 3 * x) / 4 for h, x in zip(high, low, strict=True)]
    for p in profiles:
        assert p == pytest.approx(want, abs=1e-6)

"""The cost model, the price of a node under load, the cost-model policy, and the
controller's aggregation of acceptance and online calibration."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deployments.config import PolicyArgs
from deployments.controller.state import ControllerState
from deployments.reports import ReplicaReport, TreeStats
from treespark import Budget, Calibration, random_pair
from treespark.engine.cost_measure import MeasureConfig, measure_cost_model
from treespark.pricing.costmodel import (
    AcceptanceProfile,
    AcceptanceStats,
    CostModel,
    branch_cap_for,
    marginal_price,
    plan_budget,
)
from treespark.pricing.estimators import (
    RoundWindow,
    ece_on_records,
    fit_draft_cost,
    shrink_calibration,
)
from treespark.pricing.policy import CostModelPolicy, LoadSnapshot
from treespark.spec.expand import expand
from treespark.spec.sampling import TorchSampler

# a forward with a memory-bound floor and a compute part growing with every token
AFFINE = CostModel.affine(0.08, 0.002)


def rounds_stats(rounds, max_nodes: int = 64) -> AcceptanceStats:
    """(node cap, accepted) round records as the controller aggregates them."""
    w = RoundWindow(maxlen=len(rounds), max_nodes=max_nodes)
    w.extend(rounds)
    return w.stats()


def test_cost_model_interpolates_and_round_trips(tmp_path):
    assert AFFINE.time(1, 1) == pytest.approx(0.082)
    assert AFFINE.time(3, 4) == pytest.approx(0.08 + 0.002 * 12)     # between grid points
    assert AFFINE.time(64, 8) == pytest.approx(AFFINE.time(32, 8) * 2)  # beyond: linear in bs
    assert AFFINE.slope(4, 8) == pytest.approx(0.008)
    AFFINE.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == AFFINE


@pytest.mark.parametrize("bad", [
    dict(batch_sizes=(2, 1), tokens=(1,), seconds=((1.0,), (1.0,))),
    dict(batch_sizes=(1,), tokens=(2, 4), seconds=((1.0, 1.0),)),
    dict(batch_sizes=(1,), tokens=(1,), seconds=((0.0,),)),
    dict(batch_sizes=(1,), tokens=(1, 2), seconds=((1.0,),)),
])
def test_cost_model_rejects_bad_tables(bad):
    with pytest.raises(ValueError):
        CostModel(**bad)


def test_price_rises_monotonically_with_batch_size():
    """Growing marginal cost: theta = G dT/dK / T(K) rises with the batch."""
    for n in (1, 4, 16):
        prices = [marginal_price(AFFINE, bs, n, 2.0) for bs in range(1, 33)]
        assert all(b > a for a, b in zip(prices, prices[1:], strict=False))
    plans = [plan_budget(AFFINE, AcceptanceProfile.saturating(), active=bs) for bs in range(1, 40)]
    thetas = [p.theta for p in plans]
    nodes = [p.nodes for p in plans]
    assert all(b >= a for a, b in zip(thetas, thetas[1:], strict=False))
    assert all(b <= a for a, b in zip(nodes, nodes[1:], strict=False))
    assert nodes[0] >= 8 and thetas[0] < 0.1          # light load: a big tree, cheap nodes
    assert nodes[-1] == 0 and thetas[-1] >= 1.0       # compute-bound: plain decoding


def test_free_verification_gives_theta_zero():
    flat = CostModel((1, 16), (1, 64), ((0.1, 0.1), (0.2, 0.2)))
    p = plan_budget(flat, AcceptanceProfile.saturating(max_nodes=32), active=1)
    assert p.theta == 0.0 and p.nodes == 32 and p.branch_cap == 8  # plan_budget's default max_branch


def test_a_step_in_the_forward_time_is_filled_or_avoided():
    """On CPU, 3 tokens per row cost more than 2 and 3-6 cost the same (the product
    kernel changes at 3 rows). The planner picks the best size on the measured grid:
    one node below the step, or the whole flat stretch beyond it, never a tree that
    pays the step and leaves its free tokens unused."""
    ks = (1, 2, 3, 4, 6, 8, 16)
    step = CostModel((1,), ks, ((0.040, 0.040, 0.046, 0.046, 0.046, 0.052, 0.070),))
    rich = plan_budget(step, AcceptanceProfile.saturating(0.83, 3.2), active=1)
    assert rich.nodes == 5                   # k = 6: the last token before the next rise
    # a drafter whose later nodes add little: the tree is not worth the step
    poor = AcceptanceProfile(tuple([0.0, 0.3] + [0.32] * 15))
    assert plan_budget(step, poor, active=1).nodes == 1
    # the same forward measured on powers of two only: T(1, 3) is interpolated between
    # 2 and 4 tokens, and the step looks like a slope
    coarse = CostModel((1,), (1, 2, 4, 8, 16), ((0.040, 0.040, 0.046, 0.052, 0.070),))
    assert coarse.time(1, 3) < step.time(1, 3)


def test_queue_raises_the_price():
    prof = AcceptanceProfile.saturating()
    calm = plan_budget(AFFINE, prof, active=4, queued=0)
    queue = plan_budget(AFFINE, prof, active=4, queued=8, max_batch=4)
    joining = plan_budget(AFFINE, prof, active=4, queued=4, max_batch=8)
    assert joining.queue_factor == 1 and joining.batch == 8
    assert queue.queue_factor > 1 and queue.nodes <= calm.nodes and queue.theta > calm.theta


def test_branch_cap_from_theta():
    assert branch_cap_for(0.0, 4) == 4
    assert branch_cap_for(0.3, 4) == 3
    assert branch_cap_for(0.5, 4) == 1
    assert branch_cap_for(0.9, 4) == 1


def test_acceptance_profile_blend_is_monotone_and_shrinks():
    prior = AcceptanceProfile.saturating(1.0, 4.0, max_nodes=8)
    assert AcceptanceProfile.blend(prior, None) == prior
    # many rounds at one size: the data wins over the prior there, both ways
    none = AcceptanceProfile.blend(prior, rounds_stats([(4, 0)] * 1000, max_nodes=8), prior_weight=10.0)
    assert none(4) < 0.01 * prior(4)
    lots = AcceptanceProfile.blend(prior, rounds_stats([(4, 3)] * 1000, max_nodes=8), prior_weight=10.0)
    assert lots(4) == pytest.approx(3.0, abs=0.05) and lots(4) > 2 * prior(8)
    # a smaller tree seen accepting more: kept monotone (a bigger best-first tree contains it)
    seen = rounds_stats([(4, 0)] * 1000 + [(2, 1)] * 10, max_nodes=8)
    b = AcceptanceProfile.blend(prior, seen, prior_weight=10.0)
    assert b(2) > 0.4 and b(4) == b(2)
    assert all(y >= x for x, y in zip(b.accepted, b.accepted[1:], strict=False))
    assert b(100) == b(8)
    with pytest.raises(ValueError):
        AcceptanceProfile((0.0, 1.0, 0.5))


def test_zero_acceptance_turns_speculation_off():
    never = AcceptanceProfile((0.0,) * 17)
    assert plan_budget(AFFINE, never, active=1).nodes == 0


# -- the policy ------------------------------------------------------------------------


def _budgets(policy, loads):
    return [policy.budget_for(LoadSnapshot(1, a, 0), "r") for a in loads]


def test_policy_shrinks_trees_to_chains_then_off():
    p = CostModelPolicy(AFFINE)
    bs = _budgets(p, range(0, 33))
    assert bs[0] == p.budget_for(LoadSnapshot.idle(), "r")
    assert bs[0].node_cap >= 8 and bs[0].branch_cap == p.max_branch
    for a, b in zip(bs, bs[1:], strict=False):
        assert b.theta >= a.theta and b.node_cap <= a.node_cap and b.branch_cap <= a.branch_cap
    assert bs[-1].is_off and bs[-1].theta >= 1.0 and bs[-1].node_cap == 0
    # load is per replica: two replicas at 16 running price like one at 8
    assert p.budget_for(LoadSnapshot(2, 16, 0), "r") == p.budget_for(LoadSnapshot(1, 8, 0), "r")


def test_policy_off_budget_gives_an_empty_tree():
    p = CostModelPolicy(AFFINE)
    off = p.budget_for(LoadSnapshot(1, 64, 0), "r")
    assert off.theta >= 1.0
    prop = _Proposal()
    tree = expand(prop, 3, off, Calibration(), 0.0, TorchSampler(0))
    assert tree.size == 0 and tree.width == 0
    # even with room for nodes, theta >= 1 stops the expander before the first one
    tree = expand(prop, 3, Budget(theta=off.theta, node_cap=16, branch_cap=4), Calibration(), 0.0, TorchSampler(0))
    assert tree.size == 0
    light = p.budget_for(LoadSnapshot(1, 1, 0), "r")
    assert expand(prop, 3, light, Calibration(), 0.0, TorchSampler(0)).size > 0


class _Proposal:
    """Peaked drafter logits (q of the best child ~0.95), 5 block offsets."""

    draft_to_target = None
    max_depth = 5

    def __init__(self, vocab=12):
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab, 5, vocab, generator=g) * 6

    def logits(self, parent_token, depth):
        return self.table[parent_token, depth - 1]



def test_policy_learns_from_observed_acceptance():
    p = CostModelPolicy(AFFINE, prior_weight=10.0)
    none = rounds_stats([(n, 0) for n in range(1, 33) for _ in range(100)])
    good = rounds_stats([(n, min(n, 4)) for n in range(1, 33) for _ in range(100)])
    assert p.budget_for(LoadSnapshot(1, 1, 0, acceptance=none), "r").is_off
    assert p.budget_for(LoadSnapshot(1, 8, 0, acceptance=good), "r").node_cap > \
        p.budget_for(LoadSnapshot(1, 8, 0), "r").node_cap


def test_policy_per_replica_cost_models():
    slow = CostModel.affine(0.08, 0.02)
    p = CostModelPolicy(AFFINE, replica_costs=(("gpu-less", slow),))
    load = LoadSnapshot(1, 4, 0)
    assert p.budget_for(load, "gpu-less").node_cap < p.budget_for(load, "other").node_cap


def test_policy_args_build_costmodel(tmp_path):
    AFFINE.save(tmp_path / "c.json")
    pol = PolicyArgs(kind="costmodel", cost_model=str(tmp_path / "c.json")).build()
    assert isinstance(pol, CostModelPolicy) and pol.cost == AFFINE
    inline = PolicyArgs(kind="costmodel", cost_model=AFFINE.to_json(), max_nodes=8).build()
    assert inline.budget_for(LoadSnapshot.idle(), "r").node_cap <= 8
    with pytest.raises(ValueError):
        PolicyArgs(kind="costmodel")


# -- measuring ---------------------------------------------------------------------------


def test_measure_cost_model_on_a_random_pair():
    pair = random_pair(64, 0)
    seen = []
    cfg = MeasureConfig(batch_sizes=(1, 2), tokens=(1, 4, 8), context=16, repeats=1, max_step_tokens=8)
    cm = measure_cost_model(pair.target, cfg, name="r", on_cell=lambda *a: seen.append(a))
    assert cm.batch_sizes == (1, 2) and cm.tokens == (1, 4, 8)
    assert len(seen) == 5  # one pass; (2, 8) is above max_step_tokens: extrapolated
    for row in cm.seconds:
        assert all(b >= a > 0 for a, b in zip(row, row[1:], strict=False))
    assert all(y >= x for x, y in zip(cm.seconds[0], cm.seconds[1], strict=True))


def test_measure_cost_model_keeps_each_cells_median(monkeypatch):
    """Each cell is the median of its passes, not the fastest: one quick pass must not
    make a step look cheaper than it usually is."""
    import treespark.engine.cost_measure as cost_measure

    passes = iter([0.010, 0.040, 0.030,    # pass 1: k = 1, 2, 3
                   0.011, 0.020, 0.060,    # pass 2
                   0.009, 0.025, 0.050])   # pass 3
    monkeypatch.setattr(cost_measure, "time_forward", lambda *a, **k: next(passes))
    monkeypatch.setattr(cost_measure, "_time_once", lambda *a, **k: next(passes))
    cfg = MeasureConfig(batch_sizes=(1,), tokens=(1, 2, 3), context=8, repeats=3)
    cm = measure_cost_model(random_pair(64, 0).target, cfg)
    assert cm.seconds == ((0.010, 0.025, 0.050),)


# -- the controller ----------------------------------------------------------------------


def _report(rid, active=0, rounds=(), records=(), base=None):
    return ReplicaReport(rid, active, 0, 1.0, TreeStats(steps=1, step_s=0.1),
                         {"theta": 0.0, "node_cap": 0, "branch_cap": 1}, "local", {},
                         tuple(records), None, tuple(rounds), base)


def test_round_window_aggregates_and_forgets():
    w = RoundWindow(maxlen=4, max_nodes=8)
    w.extend([(2, 1), (2, 0), (4, 3), (99, 5)])
    st = w.stats()
    assert st.counts[2] == 2 and st.sums[2] == 1 and st.mean(4) == 3 and st.counts[8] == 1
    w.extend([(1, 1), (1, 0)])  # the two oldest fall out
    st = w.stats()
    assert len(w) == 4 and st.counts[2] == 0 and st.counts[1] == 2


def test_controller_feeds_acceptance_to_the_policy():
    s = ControllerState(CostModelPolicy(AFFINE, prior_weight=10.0))
    s.report(_report("a", active=1))
    big = s.replicas["a"].budget
    assert big.node_cap > 0
    # the replicas report that nothing is ever accepted: speculation turns off
    for _ in range(5):
        s.report(_report("a", active=1, rounds=[(n, 0) for n in range(1, 33)] * 20))
    assert s.load().acceptance.rounds == 5 * 32 * 20
    assert s.replicas["a"].budget.is_off
    st = s.status()["acceptance"]
    assert st["rounds"] == 3200 and st["by_tree_size"]["4"] == [100, 0.0]
    # wire round trip
    assert ReplicaReport.from_wire(_report("b", rounds=[(3, 1)], base=(1.2, -0.3)).__dict__ | {"tree": {}}).round_records == ((3, 1),)


def test_online_calibration_shrinks_toward_stored_and_reports_ece():
    rng = random.Random(0)
    a, b = 0.6, -1.0  # the truth; the stored fit (1, 0) is overconfident
    recs = []
    for _ in range(3000):  # a replica's fixed sibling-rank offsets ride along; (a, b) is fitted around them
        x, o = rng.uniform(-5, 3), rng.choice((0.0, -1.0))
        recs.append((x, rng.random() < 1 / (1 + math.exp(-(a * x + b + o))), o))
    assert shrink_calibration((2.0, 1.0), (1.0, 0.0), 0, 100) == (1.0, 0.0)
    assert shrink_calibration((2.0, 1.0), (1.0, 0.0), 100, 100) == (1.5, 0.5)
    s = ControllerState(CostModelPolicy(AFFINE), online_calibration=True, min_calibration_records=1000,
                        calibration_prior_records=500)
    out = None
    for i in range(0, 3000, 500):
        out = s.report(_report("a", records=recs[i:i + 500], base=(1.0, 0.0)))
    ca, cb = out["calibration"]
    assert abs(ca - a) < 0.3 and abs(cb - b) < 0.4
    rep = s.status()["calibration"]["report"]
    assert rep["ece_pushed"] < rep["ece_stored"]
    assert ece_on_records(recs, a, b) < 0.05 < ece_on_records(recs, 1.0, 0.0)


def test_drafting_cost_shrinks_trees():
    prof = AcceptanceProfile.saturating()
    free = plan_budget(AFFINE, prof, active=1)
    dear = plan_budget(AFFINE, prof, active=1, node_s=0.004)
    assert dear.nodes < free.nodes and dear.theta > free.theta
    p = CostModelPolicy(AFFINE, draft_node_s=0.004)
    assert p.budget_for(LoadSnapshot(1, 1, 0), "r").node_cap == dear.nodes
    assert p.budget_for(LoadSnapshot(1, 1, 0, draft_node_s=0.0), "r").node_cap == free.nodes


def test_controller_learns_drafting_cost():
    rng = random.Random(0)
    pts = []
    for _ in range(60):
        rows = rng.randint(1, 16)
        nodes = rows * rng.randint(0, 16)
        pts.append((rows, nodes, 0.01 + 0.002 * rows + 0.0005 * nodes + rng.gauss(0, 1e-4)))
    assert fit_draft_cost(pts) == pytest.approx(0.0005, rel=0.05)
    assert fit_draft_cost(pts[:5]) is None
    assert fit_draft_cost([(1, 4, 0.01)] * 30) is None
    s = ControllerState(CostModelPolicy(AFFINE))
    for rows, nodes, d in pts:
        s.report(ReplicaReport("a", int(rows), 0, 1.0,
                               TreeStats(steps=3, batch_size=rows, mean_tree_size=nodes / rows, draft_s=d,
                                         drafting_steps=3, drafting_batch=rows, drafting_nodes=nodes, drafting_s=d),
                               {"theta": 0.0, "node_cap": 0, "branch_cap": 1}, "local", {}))
    assert s.load().draft_node_s == pytest.approx(0.0005, rel=0.05)
    assert s.status()["draft_node_s"] == pytest.approx(0.0005, rel=0.05)


def test_drafting_cost_is_learned_from_the_steps_that_drafted():
    """Heartbeat windows that mix drafting steps with plain ones (the drafter skipped,
    ~0 s) must not inflate the per-node cost. Fitted on window means, the drafter's fixed
    cost per step went into the per-node cost, which grew from 0.45 to 4.8 ms over a
    served ramp and kept trees from coming back when load fell."""
    from deployments.replica.heartbeat import summarize_steps
    from treespark.spec.params import StepStats

    def step(rows: int, nodes_per_row: int) -> StepStats:
        drafts = nodes_per_row > 0
        d = 0.004 + 0.001 * rows + 0.0005 * rows * nodes_per_row if drafts else 1e-4
        return StepStats(batch_size=rows, tokens_verified=rows * (1 + nodes_per_row),
                         tree_sizes=(nodes_per_row,) * rows, depths=(min(nodes_per_row, 1),) * rows,
                         widths=(min(nodes_per_row, 1),) * rows, accepted=(0,) * rows, theta=0.1,
                         draft_s=d, verify_s=0.03, step_s=0.03 + d, node_caps=(nodes_per_row,) * rows)

    rng = random.Random(1)
    s = ControllerState(CostModelPolicy(AFFINE))
    for _ in range(80):
        rows, nodes = rng.randint(1, 8), rng.randint(1, 6)
        window = [step(rows, nodes) for _ in range(rng.randint(1, 3))] + \
                 [step(rows, 0) for _ in range(rng.randint(0, 6))]
        s.report(ReplicaReport("a", rows, 0, 1.0, summarize_steps(window),
                               {"theta": 0.1, "node_cap": nodes, "branch_cap": 1}, "local", {}))
    assert s.load().draft_node_s == pytest.approx(0.0005, rel=0.05)


def test_blend_rescales_the_prior_for_sizes_never_seen():
    prior = AcceptanceProfile.saturating(1.3, 5.0, max_nodes=16)
    low = rounds_stats([(1, 0)] * 900 + [(1, 1)] * 100, max_nodes=16)  # 0.1 at size 1
    b = AcceptanceProfile.blend(prior, low, prior_weight=50.0)
    assert b(1) < 0.15 and b(16) < 0.5 * prior(16)   # unseen sizes scaled down with the evidence
    high = rounds_stats([(1, 1)] * 1000, max_nodes=16)
    assert AcceptanceProfile.blend(prior, high, prior_weight=50.0)(16) > prior(16)


def test_cost_model_command_measures_the_default_grid():
    """`treespark cost-model` without options measures ``MeasureConfig``'s grid, which
    holds 3 tokens per row (where the CPU product kernel changes)."""
    from treespark.cli import build_parser

    args = build_parser().parse_args(["cost-model"])
    grid = MeasureConfig()
    assert (tuple(args.batch_sizes), tuple(args.tokens), args.context, args.repeats, args.max_step_tokens) \
        == (grid.batch_sizes, grid.tokens, grid.context, grid.repeats, grid.max_step_tokens)
    assert {2, 3, 4}.issubset(grid.tokens)

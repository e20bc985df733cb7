"""Tree structure and best-first expansion."""

from __future__ import annotations

import pytest
import torch

from treespark import Budget, Calibration
from treespark.spec.expand import expand
from treespark.spec.sampling import TorchSampler
from treespark.spec.tree import DraftTree


class PeakedProposal:
    """Logits with a clear preference order under every parent."""

    draft_to_target = None

    def __init__(self, vocab=12, max_depth=5, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, max_depth, vocab, generator=g) * 3
        self.max_depth = max_depth

    def logits(self, parent_token, depth):
        return self.table[parent_token, depth - 1]


class MarginalProposal(PeakedProposal):
    """Per-depth marginals that ignore the parent (the signal of earlier trees)."""

    def logits(self, parent_token, depth):
        return self.table[:, depth - 1].mean(0)


def grow(budget, temperature=0.0, seed=0, cal=None, proposal=PeakedProposal):
    return expand(proposal(), 0, budget, cal or Calibration(), temperature, TorchSampler(seed))


def test_ancestor_mask_and_positions():
    t = DraftTree.root_only(5)
    a = t.add(0, 1, 0.5, 0.5)
    b = t.add(0, 2, 0.3, 0.3)
    c = t.add(a, 3, 0.4, 0.2)
    t.check()
    m = t.ancestor_mask()
    assert m[c].tolist() == [True, True, False, True]
    assert m[b].tolist() == [True, False, True, False]
    assert t.position_offsets().tolist() == [0, 1, 1, 2]
    assert (t.size, t.depth, t.width) == (3, 2, 2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_and_off_are_ordinary_budgets(temperature):
    chain = grow(Budget.chain(4), temperature)
    chain.check()
    assert chain.size == 4 and chain.width == 1 and chain.depth == 4
    assert grow(Budget.off(), temperature).size == 0
    assert grow(Budget(theta=1.0, node_cap=16, branch_cap=4), temperature).size == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caps_are_respected_and_siblings_distinct(temperature):
    for seed in range(5):
        t = grow(Budget(theta=0.0, node_cap=20, branch_cap=3), temperature, seed)
        t.check()
        assert t.size == 20
        assert max(len(c) for c in t.children) <= 3
        assert t.depth <= 5


def test_theta_shrinks_trees_monotonically():
    sizes = [grow(Budget(theta=th, node_cap=64, branch_cap=4)).size for th in (0.0, 0.01, 0.05, 0.2, 0.5)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_survival_is_a_product_along_paths():
    cal = Calibration(1.3, -0.2)
    t = grow(Budget(theta=0.0, node_cap=16, branch_cap=3), cal=cal)
    for i in range(1, t.num_nodes):
        expected = t.survival[t.parents[i]] * cal.p_hat_scalar(t.q[i])
        assert t.survival[i] == pytest.approx(expected)
        assert t.survival[i] <= t.survival[t.parents[i]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sibling_offsets_reshape_trees(temperature):
    """Negative offsets for later siblings trade width for depth at the same node count;
    survival uses each edge's own rank."""
    b = Budget(theta=0.0, node_cap=12, branch_cap=4)
    base = Calibration(1.0, 0.0)
    seeds = range(8) if temperature > 0 else range(1)  # at T > 0, over several draws
    plains = [grow(b, temperature, seed, cal=base) for seed in seeds]
    narrows = [grow(b, temperature, seed, cal=Calibration(1.0, 0.0, sibling_bias=(-4.0, -6.0)))
               for seed in seeds]
    assert all(t.size == 12 for t in plains + narrows)
    assert sum(t.width for t in narrows) < sum(t.width for t in plains)
    assert sum(sum(t.depths) for t in narrows) > sum(sum(t.depths) for t in plains)
    plain = plains[0]
    assert grow(b, temperature, cal=Calibration(1.0, 0.0, sibling_bias=(0.0,))).tokens == plain.tokens
    if temperature == 0.0:
        cal = Calibration(1.0, 0.0, sibling_bias=(-1.0, -2.0))
        t = grow(b, cal=cal)
        for i in range(1, t.num_nodes):
            r = t.children[t.parents[i]].index(i)
            assert t.survival[i] == pytest.approx(t.survival[t.parents[i]] * cal.p_hat_scalar(t.q[i], r))


def test_a_sampled_map_drafts_every_t_above_zero_and_only_those():
    """``Calibration.sampled`` grows the trees at T > 0; T = 0 keeps the top-level map."""
    b = Budget(theta=0.05, node_cap=32, branch_cap=4)
    top = Calibration(1.0, 0.0)
    two = Calibration(1.0, 0.0, sampled=Calibration(1.0, -8.0))  # sampled edges rated near zero
    assert grow(b, 0.0, cal=two).tokens == grow(b, 0.0, cal=top).tokens
    for t in (0.5, 1.0):
        assert grow(b, t, cal=top).size > 2 and grow(b, t, cal=two).size == 0
    assert grow(b, 1.0, cal=Calibration(1.0, -8.0, sampled=top)).tokens == grow(b, 1.0, cal=top).tokens


def test_greedy_children_are_the_top_k():
    t = grow(Budget(theta=0.0, node_cap=3, branch_cap=3))
    top = torch.softmax(PeakedProposal().logits(0, 1), -1).topk(3).indices.tolist()
    assert [t.tokens[c] for c in t.children[0]] == top[: len(t.children[0])]


def test_best_first_takes_the_most_likely_nodes():
    """With theta 0 and a node cap, every excluded slot scores below every included node."""
    t = grow(Budget(theta=0.0, node_cap=10, branch_cap=2))
    big = grow(Budget(theta=0.0, node_cap=40, branch_cap=2))
    small_set = sorted(t.survival[1:], reverse=True)
    assert small_set == sorted(big.survival[1:], reverse=True)[:10]


def test_rankings_differ():
    b = Budget(theta=0.0, node_cap=12, branch_cap=3)
    cal = grow(b, cal=Calibration(3.0, -2.0))
    logq = grow(b, cal=Calibration(1.0, 0.0))  # p_hat = q: the raw path probability (EAGLE-2)
    marg = grow(b, proposal=MarginalProposal)
    for t in (cal, logq, marg):
        t.check()
        assert t.size == 12
    # marginal ranking gives every parent the same candidates
    firsts = {tuple(sorted(marg.tokens[c] for c in marg.children[n])) for n in range(marg.num_nodes)
              if len(marg.children[n]) == 3}
    assert len(firsts) <= 5

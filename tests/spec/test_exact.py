"""Layer b: the exact output distribution of one tree round equals the target's.

We enumerate every random event of one round, the sibling draws of the expansion
and the accept/reject/residual draws of verification, with a sampler that replays
scripted outcomes and branches on the first unscripted one. The emitted tokens are
then continued by exact target sampling to a fixed length D, and the resulting
distribution over V^D is compared to the target's own joint distribution.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from treespark import Budget, Calibration
from treespark.spec.expand import expand
from treespark.spec.sampling import TorchSampler, target_probs
from treespark.spec.verify import residual, verify_sampled

V, D = 3, 3


class Branch(Exception):
    def __init__(self, options):
        self.options = options


class ReplaySampler:
    def __init__(self, script):
        self.script, self.i, self.prob = script, 0, 1.0

    def _next(self, options):
        if self.i == len(self.script):
            raise Branch(options)
        choice = self.script[self.i]
        self.i += 1
        self.prob *= dict(options)[choice]
        return choice

    def categorical(self, probs):
        return self._next([(i, p) for i, p in enumerate(probs.tolist()) if p > 0])

    def bernoulli(self, p):
        return self._next([(o, w) for o, w in ((True, p), (False, 1.0 - p)) if w > 0])


def draft_paths(tree) -> list[tuple[int, ...]]:
    """Each node's draft tokens from the root down (the root's path is empty)."""
    paths = []
    for i in range(tree.num_nodes):
        node, path = i, []
        while node > 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        paths.append(tuple(reversed(path)))
    return paths


def logits_for(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    return _logits(prefix, salt).clone()


@functools.cache
def _logits(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt, prefix)) % (2**31))
    return torch.randn(V, generator=g, dtype=torch.float64) * 1.5


class TableProposal:
    """A drafter whose q depends on depth and parent (and differs from the target)."""

    max_depth = 3
    draft_to_target = None

    def logits(self, parent_token, depth):
        return logits_for((parent_token, depth), salt=1)


class MarginalProposal(TableProposal):
    """Earlier trees' signal: the same candidates under every parent."""

    def logits(self, parent_token, depth):
        return logits_for((depth,), salt=2)


def target_dist(path: tuple[int, ...], temperature: float) -> torch.Tensor:
    return _target_dist(tuple(path), temperature).clone()


@functools.cache
def _target_dist(path: tuple[int, ...], temperature: float) -> torch.Tensor:
    return target_probs(logits_for(path, salt=0), temperature)


CAL = Calibration(1.2, -0.3)


def enumerate_round(budget, temperature, verifier=verify_sampled, proposal=TableProposal, cal=CAL):
    """{emitted tokens continued to length D: probability}."""
    root = 0
    dist: dict[tuple[int, ...], float] = {}
    stack = [[]]
    while stack:
        script = stack.pop()
        s = ReplaySampler(script)
        try:
            tree = expand(proposal(), root, budget, cal, temperature, s)
            paths = draft_paths(tree)
            p = torch.stack([target_dist(pt, temperature) for pt in paths])
            out = verifier(tree, p, s)
        except Branch as b:
            stack += [script + [o] for o, _ in b.options]
            continue
        tokens = tuple(out.tokens[:D])
        for tail in itertools.product(range(V), repeat=D - len(tokens)):
            seq, prob = tokens + tail, s.prob
            for j in range(len(tokens), D):
                prob *= float(target_dist(seq[:j], temperature)[seq[j]])
            dist[seq] = dist.get(seq, 0.0) + prob
    return dist


def target_joint(temperature):
    joint = {}
    for seq in itertools.product(range(V), repeat=D):
        joint[seq] = math.prod(float(target_dist(seq[:j], temperature)[seq[j]]) for j in range(D))
    return joint


def tv(a, b):
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


BUDGETS = [Budget(theta=0.0, node_cap=4, branch_cap=2),    # width 2, depth 2+
           Budget(theta=0.15, node_cap=5, branch_cap=3)]   # adaptive stop on survival


@pytest.mark.parametrize("budget, temperature", [
    pytest.param(BUDGETS[0], 0.5, marks=pytest.mark.slow, id="fixed-0.5"),  # ~45 s: with -m slow
    *[pytest.param(BUDGETS[0], t, id=f"fixed-{t}") for t in (1.0, 2.0)],
    *[pytest.param(BUDGETS[1], t, id=f"adaptive-{t}") for t in (0.5, 1.0, 2.0)]])
def test_one_round_is_lossless(temperature, budget):
    dist = enumerate_round(budget, temperature)
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    assert tv(dist, target_joint(temperature)) < 1e-6


@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("budget", [pytest.param(BUDGETS[0], marks=pytest.mark.slow), BUDGETS[1]],
                         ids=["fixed", "adaptive"])
def test_sibling_rank_offsets_stay_lossless(temperature, budget):
    """Per-rank calibration changes which slots are opened (rank-dependent expected
    acceptance), never the output distribution. (The fixed budget's enumerations take
    ~30 s each: with -m slow.)"""
    cal = Calibration(1.2, -0.3, sibling_bias=(-1.5, -0.5))
    dist = enumerate_round(budget, temperature, cal=cal)
    assert tv(dist, target_joint(temperature)) < 1e-6


def test_drafting_at_a_scaled_temperature_stays_lossless():
    """Drafts drawn from q at scale x T (``Calibration.temperature_scale``) are
    verified against that q: the output is still the target's at T."""
    temperature, scale = 1.0, 0.5
    cal = Calibration(1.2, -0.3, sampled=Calibration(1.2, -0.3, temperature_scale=scale))
    budget = Budget(theta=0.0, node_cap=3, branch_cap=2)  # width 2, depth 2: small enough to enumerate fast
    tree = expand(TableProposal(), 0, budget, cal, temperature, TorchSampler(0))
    assert torch.allclose(tree.child_q[0], target_probs(logits_for((0, 1), salt=1), scale * temperature))
    assert tv(enumerate_round(budget, temperature, cal=cal), target_joint(temperature)) < 1e-6


def test_trees_in_the_enumeration_are_wide_and_deep():
    seen_width, seen_depth = 0, 0
    for script in itertools.product([0, 1, 2], repeat=6):
        try:
            t = expand(TableProposal(), 0, BUDGETS[0], Calibration(1.2, -0.3), 1.0, ReplaySampler(list(script)))
        except (Branch, KeyError):
            continue
        seen_width, seen_depth = max(seen_width, t.width), max(seen_depth, t.depth)
    assert seen_width >= 2 and seen_depth >= 2


def test_marginal_ranking_is_lossless_too():
    dist = enumerate_round(BUDGETS[0], 1.0, proposal=MarginalProposal)
    assert tv(dist, target_joint(1.0)) < 1e-6


def verify_with_replacement(tree, target, sampler):
    """A deliberately wrong verifier: it forgets to remove drawn siblings from q."""
    from treespark.spec.verify import VerifyResult

    node, path = 0, []
    while True:
        p, accepted = target[node], None
        if tree.children[node]:
            q = tree.child_probs_full(node, target.shape[1])
            for child in tree.children[node]:
                x = tree.tokens[child]
                if sampler.bernoulli(min(1.0, float(p[x]) / float(q[x]))):
                    accepted = child
                    break
                p = residual(p, q)
        if accepted is None:
            return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path) + (sampler.categorical(p),), ())
        path.append(accepted)
        node = accepted


def test_the_enumeration_detects_a_lossy_verifier():
    dist = enumerate_round(BUDGETS[1], 1.0, verifier=verify_with_replacement)   # tv 0.0058
    assert tv(dist, target_joint(1.0)) > 1e-3

"""A greedy round grown in one native call (``treespark.spec.native_forest``) against the
waves grown in Python (``WaveDrafter(native=False)``): the same trees, kept sets, scores
and wave counts, on random drafters, budgets, depth limits and calibrations."""

import numpy as np
import pytest
import torch

from treespark import Budget, Calibration
from treespark.kernels.native import library
from treespark.kernels.transfer import HostTransfers
from treespark.spec import native_forest
from treespark.spec.drafting import RowDraft, WaveDrafter
from treespark.spec.sampling import TorchSampler

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: no native waves")

MAPS = (Calibration(1.3, -0.2, sibling_bias=(-0.5, -0.9)), Calibration(0.9, 0.4))


def random_drafter(g: torch.Generator, vocab: int, draft_vocab: int, rank: int, d2t: bool):
    w1 = torch.randn(vocab, rank, generator=g)
    w2 = torch.randn(draft_vocab, rank, generator=g) * 0.4
    ids = torch.randperm(vocab, generator=g)[:draft_vocab] if d2t else None
    return w1, w2, ids


def random_rows(rng, g, n: int, vocab: int, block: int):
    rows = []
    for _ in range(n):
        budget = Budget.off() if rng.random() < 0.1 else Budget(
            float(rng.choice([0.0, 0.0, 0.02, 0.1, 0.3])), int(rng.integers(1, 33)), int(rng.integers(1, 5)))
        rows.append(RowDraft(root=int(rng.integers(0, vocab)), budget=budget,
                             depth_limit=int(rng.integers(0, block + 1)), temperature=0.0,
                             calibration=MAPS[int(rng.integers(0, 2))], sampler=TorchSampler(0)))
    return rows


@pytest.mark.parametrize("d2t", [False, True])
def test_native_greedy_waves_grow_the_python_waves_trees(d2t, monkeypatch):
    """Each round grows in one native call, in room for every node it can open: some of
    these rounds hold more candidates a row than the Python forest starts with (a node
    pushed out of the top keeps its children), and their trees match too."""
    codes, past_start = [], []
    grow = native_forest._grow

    def grow_once(lib, forest, base, w1, w2p, calibrations, caps, *out):
        codes.append(grow(lib, forest, base, w1, w2p, calibrations, caps, *out))
        start = 1 + (int(forest.node_cap.max(initial=0)) + 1) * int(caps.max(initial=1))
        past_start.append(int(forest.size.max()) > start)
        return codes[-1]

    monkeypatch.setattr(native_forest, "_grow", grow_once)
    rng = np.random.default_rng(int(d2t))
    g = torch.Generator().manual_seed(int(d2t))
    vocab, draft_vocab, rank, block = 3000, 2048, 12, 6
    w1, w2, ids = random_drafter(g, vocab, draft_vocab, rank, d2t)
    transfers = HostTransfers(torch.device("cpu"))
    native, python = (WaveDrafter(w1, w2, ids, transfers, native=n) for n in (True, False))
    nodes = waves = 0
    for _ in range(40):
        n = int(rng.integers(1, 6))
        rows = random_rows(rng, g, n, vocab, block)
        base = torch.randn(n, block, draft_vocab, generator=g) * float(rng.choice([1.0, 3.0]))
        a, b = native.draft(base, rows), python.draft(base, rows)
        assert a.waves == b.waves
        for ta, tb, sa, sb, da, db in zip(a.trees, b.trees, a.scores, b.scores, a.draft_ids, b.draft_ids,
                                         strict=True):
            assert ta.tokens == tb.tokens and ta.parents == tb.parents and da == db
            assert np.allclose(ta.q, tb.q, rtol=1e-5, atol=1e-9)
            assert np.allclose(ta.survival, tb.survival, rtol=1e-5, atol=1e-12)
            assert np.allclose(sa, sb, rtol=1e-5, atol=1e-12)
        assert all(r == [-1] * len(t.tokens) for r, t in zip(a.q_row_of, a.trees, strict=True))
        nodes += sum(t.num_nodes for t in a.trees)
        waves += a.waves
    assert nodes > 200 and waves > 60   # the rounds drafted real trees
    assert len(codes) == 40 and min(codes) >= 0 and any(past_start)


def test_a_round_with_a_sampled_row_is_grown_in_python():
    """The native call grows T = 0 rows only: a round with a row at T > 0 takes the waves
    here (its draws come from the row's own generator, its q rows stay for verification)."""
    g = torch.Generator().manual_seed(0)
    w1, w2, _ = random_drafter(g, 1000, 512, 8, False)
    drafter = WaveDrafter(w1, w2, None, HostTransfers(torch.device("cpu")))
    base = torch.randn(2, 4, 512, generator=g)
    greedy = RowDraft(root=3, budget=Budget(0.0, 8, 2), depth_limit=4, temperature=0.0, calibration=MAPS[0],
                      sampler=TorchSampler(0))
    assert drafter._greedy_natively(base, [greedy, greedy])
    sampled = RowDraft(root=5, budget=Budget(0.0, 8, 2), depth_limit=4, temperature=1.0, calibration=MAPS[0],
                       sampler=TorchSampler(1))
    assert not drafter._greedy_natively(base, [greedy, sampled])
    out = drafter.draft(base, [greedy, sampled])
    assert out.q_rows is not None and out.q_rows.shape[0] > 0


def test_the_native_round_is_an_operator_to_the_profiler():
    """Host-share figures count operator time: the native round is one, as a native product is."""
    from torch.profiler import ProfilerActivity, profile

    from treespark.spec.native_forest import PROFILER_NAME

    g = torch.Generator().manual_seed(0)
    w1, w2, _ = random_drafter(g, 1000, 512, 8, False)
    drafter = WaveDrafter(w1, w2, None, HostTransfers(torch.device("cpu")))
    row = RowDraft(root=3, budget=Budget(0.0, 8, 2), depth_limit=4, temperature=0.0, calibration=MAPS[0],
                   sampler=TorchSampler(0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = drafter.draft(torch.randn(1, 4, 512, generator=g), [row])
    ev = {e.key: e for e in prof.key_averages()}
    assert out.waves > 0 and ev[PROFILER_NAME].count == 1


def test_a_rows_native_tree_does_not_depend_on_the_rows_beside_it():
    """Each logit is the same chain of operations whoever shares the wave (the product
    groups parents by four): a row drafted alone and in a batch of 7 gets the same tree,
    bit for bit."""
    rng = np.random.default_rng(5)
    g = torch.Generator().manual_seed(5)
    vocab, draft_vocab, rank, block = 3000, 1000, 12, 5   # a vocabulary that is no multiple of 16
    w1, w2, _ = random_drafter(g, vocab, draft_vocab, rank, False)
    drafter = WaveDrafter(w1, w2, None, HostTransfers(torch.device("cpu")))
    rows = [RowDraft(root=int(rng.integers(0, vocab)), budget=Budget(0.0, 24, 3), depth_limit=block,
                     temperature=0.0, calibration=MAPS[0], sampler=TorchSampler(0)) for _ in range(7)]
    base = torch.randn(7, block, draft_vocab, generator=g)
    together = drafter.draft(base, rows)
    for i in (0, 3, 6):
        alone = drafter.draft(base[i:i + 1].clone(), [rows[i]])
        assert alone.trees[0].tokens == together.trees[i].tokens
        assert alone.trees[0].q == together.trees[i].q and alone.scores[0] == together.scores[i]

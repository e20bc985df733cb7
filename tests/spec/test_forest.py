"""``Forest`` (a batch's trees as arrays, the engine's) against ``TreeBuilder`` (one
request's tree node by node, the host reference's): the same waves, in the same order,
and the same trees, on random budgets and slots (ties included)."""

import numpy as np
import pytest

from treespark import Budget, Calibration
from treespark.spec.forest import Forest
from treespark.spec.select import SlotArrays, Slots, TreeBuilder, slot_table

CAL = Calibration(1.3, -0.2, sibling_bias=(-0.5, -0.9))
VOCAB = 12


def random_budget(rng):
    if rng.random() < 0.1:
        return Budget.off()
    theta = float(rng.choice([0.0, 0.0, 0.01, 0.1, 0.125, 0.25, 0.3, rng.random() * 0.5]))
    return Budget(theta, int(rng.integers(0, 13)), int(rng.integers(1, 5)))


def random_slots(rng, p, k, regime):
    """Slots for p opened nodes: from ``slot_table`` (T = 0 or T > 0), or coarse values
    that tie often (equal expectations, and so equal scores, within and across nodes)."""
    if regime == "ties":
        count = rng.integers(0, k + 1, size=p)
        levels = np.array([1.0, 0.5, 0.5, 0.25, 0.125])
        expected = np.sort(rng.choice(levels, size=(p, k)), 1)[:, ::-1].copy()
        realized = rng.choice(levels, size=(p, k))
        ids = np.stack([rng.permutation(VOCAB)[:k] for _ in range(p)])
        return SlotArrays(ids, rng.random((p, k)), expected, realized, count)
    q = rng.dirichlet(np.full(VOCAB, 0.3), size=p)
    q[::3, VOCAB // 2:] = 0.0                      # some nodes have a small support
    q /= q.sum(1, keepdims=True)
    top_ids = np.argsort(-q, 1, kind="stable")[:, :8]
    top_q = np.take_along_axis(q, top_ids, 1)
    if regime == "greedy":
        return slot_table(top_q, top_ids, None, None, CAL, k, VOCAB)
    drawn_ids = np.stack([rng.choice(VOCAB, k, replace=False, p=row) if (row > 0).sum() >= k
                          else np.argsort(-row, kind="stable")[:k] for row in q])
    drawn_q = np.take_along_axis(q, drawn_ids, 1)
    return slot_table(top_q, top_ids, drawn_ids, drawn_q, CAL, k, VOCAB)


def as_slots(s: SlotArrays, i: int) -> Slots:
    c = int(s.count[i])
    return Slots(tuple(s.ids[i, :c].tolist()), tuple(s.q[i, :c].tolist()),
                 tuple(s.expected[i, :c].tolist()), tuple(s.realized[i, :c].tolist()))


@pytest.mark.parametrize("regime", ["greedy", "sampled", "ties"])
def test_the_forest_grows_the_reference_trees(regime):
    rng = np.random.default_rng({"greedy": 0, "sampled": 1, "ties": 2}[regime])
    d2t = rng.permutation(100)[:VOCAB]
    waves = grown = 0
    for _ in range(150):
        n = int(rng.integers(1, 7))
        budgets = [random_budget(rng) for _ in range(n)]
        limits = rng.integers(0, 7, size=n).tolist()
        roots = rng.integers(0, 100, size=n).tolist()
        mapped = rng.random() < 0.5
        forest = Forest(roots, budgets, limits, d2t if mapped else None)
        cap0 = forest.parent.shape[1]
        builders = [TreeBuilder(r, b, lim, d2t.tolist() if mapped else None)
                    for r, b, lim in zip(roots, budgets, limits, strict=True)]
        while True:
            rows, nodes = forest.to_open()
            want = [(b, x) for b, bl in enumerate(builders) for x in bl.to_open()]
            assert list(zip(rows.tolist(), nodes.tolist(), strict=True)) == want
            if not want:
                break
            waves += 1
            k = max(budgets[b].branch_cap for b, _ in want)
            slots = random_slots(rng, len(want), k, regime)
            # a row's budget offers its own branch_cap slots: the first ones
            slots.count[:] = np.minimum(slots.count, [budgets[b].branch_cap for b, _ in want])
            forest.open(rows, nodes, slots)
            for i, (b, x) in enumerate(want):
                builders[b].open(x, as_slots(slots, i))
        grown += forest.parent.shape[1] > cap0
        trees, keeps = forest.finish()
        for b, bl in enumerate(builders):
            tree, keep = bl.finish()
            assert keeps[b].tolist() == keep
            got = trees[b]
            got.check()
            for field in ("tokens", "parents", "depths", "q", "survival", "children"):
                assert getattr(got, field) == getattr(tree, field), field
            assert forest.score[b, keep[1:]].tolist() == [bl.nodes[c].score for c in keep[1:]]
            assert forest.draft_id[b, keep].tolist() == [bl.nodes[c].draft_id for c in keep]
    assert waves > 300   # the trials do grow trees, over several waves
    print(f"{waves} waves; the candidate arrays grew in {grown} forests")


def test_opening_a_node_twice_is_refused():
    forest = Forest([5], [Budget(0.0, 4, 2)], [3])
    rows, nodes = forest.to_open()
    slots = SlotArrays(np.array([[1, 2]]), np.array([[0.6, 0.3]]), np.array([[0.7, 0.4]]),
                       np.array([[0.7, 0.4]]), np.array([2]))
    forest.open(rows, nodes, slots)
    with pytest.raises(AssertionError):
        forest.open(rows, nodes, slots)

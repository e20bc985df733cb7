"""The device walk (``walk_sampled``) against the rule written out pass by pass.

``reference_walk`` is the recursive rejection walk as the rule states it: at every
sibling it materialises the residual p <- norm(max(p - q, 0)) and the proposal q
without the drawn token. ``walk_sampled`` carries a few numbers per sibling instead; on
the same uniforms both must accept the same nodes and draw the same last token."""

from __future__ import annotations

import pytest
import torch

from treespark.kernels.compile import compiled
from treespark.spec.sampling import sample_rows, target_probs_rows
from treespark.spec.walk import SampledTrees, walk_level, walk_sampled


def reference_walk(logits, temperature, top_p, trees, q_rows, q_totals, d2t, accept_u, final_u):
    r = logits.shape[0]
    ar = torch.arange(r)
    cur = torch.zeros(r, dtype=torch.long)
    active = torch.ones(r, dtype=torch.bool)
    path = torch.full((r, trees.depth + 1), -1, dtype=torch.long)
    p_last = None
    for d in range(trees.depth + 1):
        p = target_probs_rows(logits[ar, cur], temperature, top_p)
        qi = trees.q_row[ar, cur]
        qc = qi.clamp(min=0)
        q = q_rows[qc].to(torch.float64) / q_totals[qc, None]
        taken = torch.full((r,), -1, dtype=torch.long)
        for j in range(trees.children.shape[2]):
            child = trees.children[ar, cur, j]
            live = active & (taken < 0) & (child >= 0) & (qi >= 0)
            c = child.clamp(min=0)
            x, xd = trees.tokens[ar, c], trees.draft_ids[ar, c]
            px = p.gather(1, x[:, None])[:, 0]
            qx = q.gather(1, xd[:, None])[:, 0]
            ok = live & (qx > 0) & (accept_u[:, d, j] * qx < px)
            taken = torch.where(ok, child, taken)
            rej = (live & ~ok)[:, None]
            res = p.clone()
            if d2t is None:
                res -= q
            else:
                res[:, d2t] -= q
            res.clamp_(min=0.0)
            mass = res.sum(-1, keepdim=True)
            p = torch.where(rej & (mass > 0), res / mass.clamp(min=1e-300), p)
            q2 = q.scatter(1, xd[:, None], 0.0)
            q = torch.where(rej, q2 / q2.sum(-1, keepdim=True).clamp(min=1e-300), q)
        stop = active & (taken < 0)
        p_last = torch.where(stop[:, None], p, p if p_last is None else p_last)
        active = active & (taken >= 0)
        path[:, d] = torch.where(active, taken, -1)
        cur = torch.where(active, taken, cur)
    path[:, trees.depth] = sample_rows(p_last, final_u)
    return path


def random_trees(g, r, k, c, vd, d2t):
    """Random trees of ``k`` nodes (each node's parent earlier, at most ``c`` children),
    distinct sibling tokens, and a q row per node that has children."""
    tokens = torch.zeros(r, k, dtype=torch.long)
    ids = torch.zeros(r, k, dtype=torch.long)
    children = torch.full((r, k, c), -1, dtype=torch.long)
    q_row = torch.full((r, k), -1, dtype=torch.long)
    depth, rows = 0, 0
    for i in range(r):
        kids: list[list[int]] = [[]]
        depths = [0]
        for n in range(1, k):
            open_ = [p for p in range(n) if len(kids[p]) < c]
            p = open_[int(torch.randint(len(open_), (1,), generator=g))]
            taken = {int(ids[i, s]) for s in kids[p]}
            x = int(torch.randint(vd, (1,), generator=g))
            while x in taken:
                x = (x + 1) % vd
            kids[p].append(n)
            kids.append([])
            depths.append(depths[p] + 1)
            ids[i, n] = x
            tokens[i, n] = x if d2t is None else int(d2t[x])
        for n, ch in enumerate(kids):
            children[i, n, :len(ch)] = torch.tensor(ch, dtype=torch.long)
            if ch:
                q_row[i, n] = rows
                rows += 1
        depth = max(depth, max(depths))
    return SampledTrees(tokens, ids, children, q_row, depth), rows


@pytest.mark.parametrize(("d2t_size", "top_p", "backend"),
                         [(0, None, None), (24, None, None), (0, 0.8, None), (24, 0.8, None),
                          (24, 0.8, "aot_eager"), (24, 0.8, "inductor")])
def test_the_walk_equals_the_rule_written_out(d2t_size, top_p, backend):
    # each depth eager, traced (aot_eager: torch's kernels) or compiled (inductor's kernels,
    # float64 sums in another order: the same tokens, these uniforms being nowhere near a tie)
    level = walk_level if backend is None else compiled(walk_level, backend)
    g = torch.Generator().manual_seed(7 + d2t_size)
    v, r, k, c = 40, 64, 9, 3
    vd = d2t_size or v
    d2t = None if not d2t_size else torch.randperm(v, generator=g)[:vd]
    trees, n_q = random_trees(g, r, k, c, vd, d2t)
    # the target and the proposal close enough that every branch of the walk is taken
    logits = torch.randn(r, k, v, generator=g) * 1.5
    q_rows = torch.softmax(torch.randn(n_q, vd, generator=g) * 1.5, -1) * 0.9
    q_rows[::5, : vd // 2] = 0.0                     # some proposals without support on half the vocabulary
    q_totals = q_rows.to(torch.float64).sum(-1)
    temperature = torch.rand(r, generator=g, dtype=torch.float64) + 0.5
    tp = None if top_p is None else torch.full((r,), top_p)
    accept_u = torch.rand(r, trees.depth + 1, c, generator=g, dtype=torch.float64)
    final_u = torch.rand(r, generator=g, dtype=torch.float64)
    want = reference_walk(logits, temperature, tp, trees, q_rows, q_totals, d2t, accept_u, final_u)
    got = walk_sampled(logits, torch.arange(r), temperature, tp, trees, q_rows, q_totals, d2t, accept_u, final_u,
                       level)
    assert (want[:, :-1] >= 0).any(), "some siblings must be accepted"
    assert torch.equal(got, want)
    # the rows of a bigger step, picked by index, walk alike
    wide = torch.cat([torch.randn(3, k, v, generator=g), logits])
    got = walk_sampled(wide, torch.arange(3, 3 + r), temperature, tp, trees, q_rows, q_totals, d2t,
                       accept_u, final_u, level)
    assert torch.equal(got, want)

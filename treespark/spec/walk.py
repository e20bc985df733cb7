"""Recursive rejection sampling on the device, along the visited path only.

The rule is ``treespark.spec.verify.verify_sampled``'s (the host reference); this is the
same walk for a batch of T > 0 rows at once, with no host round trip inside it. Each
depth step reads the target distribution p at every row's current node and its
children's proposal q (the drafting rows kept on the device), then tries the children
in draw order: accept x_j when u_j * q_j(x_j) < p_j(x_j); on rejection p <- norm(max(p -
q, 0)) and q loses x_j. A row stops at the first node where no child is accepted and
draws its last token from the residual there (inverse CDF). The uniforms come from
each request's own generator. Cost: one [rows, V] pass per sibling per depth, whatever
the tree's size; out come ``[rows, depth + 1]`` integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespark.spec.sampling import sample_rows, target_probs_rows
from treespark.spec.tree import DraftTree


@dataclass(frozen=True)
class SampledTrees:
    """The T > 0 rows' trees as padded device tensors (built on the host, copied once)."""

    tokens: torch.Tensor     # [R, K] token ids
    draft_ids: torch.Tensor  # [R, K] draft-vocabulary index of each node's token
    children: torch.Tensor   # [R, K, C] child node indices in draw order (-1: none)
    q_row: torch.Tensor      # [R, K] row of ``q_rows`` each node's children were drawn from (-1: none)
    depth: int               # the deepest node of any row

    @classmethod
    def pad(cls, trees: list[DraftTree], draft_ids: list[list[int]], q_row_of: list[list[int]],
            width: int, device: torch.device) -> SampledTrees:
        """The rows' trees padded to ``width`` nodes and to the widest branching, on ``device``."""
        r, c = len(trees), max(branching(t) for t in trees)
        tokens = torch.zeros(r, width, dtype=torch.long)
        ids = torch.zeros(r, width, dtype=torch.long)
        children = torch.full((r, width, c), -1, dtype=torch.long)
        q_row = torch.full((r, width), -1, dtype=torch.long)
        for j, t in enumerate(trees):
            tokens[j, :t.num_nodes] = torch.tensor(t.tokens)
            ids[j, :t.num_nodes] = torch.tensor(draft_ids[j]).clamp(min=0)  # the root's -1 is never read
            q_row[j, :t.num_nodes] = torch.tensor(q_row_of[j])
            for n, ch in enumerate(t.children):
                children[j, n, :len(ch)] = torch.tensor(ch, dtype=torch.long)
        return cls(tokens.to(device), ids.to(device), children.to(device), q_row.to(device),
                   max(t.depth for t in trees))


def branching(tree: DraftTree) -> int:
    """The most children any node of ``tree`` has (at least 1)."""
    return max([len(ch) for ch in tree.children] + [1])


@torch.no_grad()
def walk_sampled(
    logits: torch.Tensor,        # [R, K, V] target logits at every node
    temperature: torch.Tensor,   # [R]
    top_p: torch.Tensor | None,  # [R] (None: 1 for every row)
    trees: SampledTrees,
    q_rows: torch.Tensor,        # [Q, Vd] float32 drafting weights
    q_totals: torch.Tensor,      # [Q] float64 their totals: q = row / total, as drawn
    draft_to_target: torch.Tensor | None,  # [Vd] token id of each draft index
    accept_u: torch.Tensor,      # [R, depth + 1, C] uniforms for the sibling tests
    final_u: torch.Tensor,       # [R] uniforms for the last token
) -> torch.Tensor:
    """Returns [R, depth + 1] long: the accepted nodes, root to leaf (-1 after the
    last), then the token drawn at the last accepted node."""
    r = logits.shape[0]
    dev = logits.device
    ar = torch.arange(r, device=dev)
    cur = torch.zeros(r, dtype=torch.long, device=dev)
    active = torch.ones(r, dtype=torch.bool, device=dev)
    path = torch.full((r, trees.depth + 1), -1, dtype=torch.long, device=dev)
    p_last = None
    for d in range(trees.depth + 1):
        p = target_probs_rows(logits[ar, cur], temperature, top_p)          # [R, V]
        qi = trees.q_row[ar, cur]
        q = None
        if q_rows is not None:
            qc = qi.clamp(min=0)
            q = q_rows[qc].to(torch.float64) / q_totals[qc, None]                  # [R, Vd]
        taken = torch.full((r,), -1, dtype=torch.long, device=dev)
        for j in range(trees.children.shape[2] if q is not None else 0):
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
            if draft_to_target is None:
                res -= q
            else:
                res[:, draft_to_target] -= q
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

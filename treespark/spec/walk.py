"""Recursive rejection sampling on the device, along the visited path only.

The rule is ``treespark.spec.verify.verify_sampled``'s (the host reference); this is the
same walk for a batch of T > 0 rows at once, with no host round trip inside it. Each
depth step reads the target distribution p at every row's current node and its
children's proposal q (the drafting rows kept on the device), then tries the children
in draw order: accept x_j when u_j * q_j(x_j) < p_j(x_j); on rejection p <- norm(max(p -
q, 0)) and q loses x_j. A row stops at the first node where no child is accepted and
draws its last token from the residual there (inverse CDF). The uniforms come from
each request's own generator. Cost per visited depth: the target distribution at
the rows' nodes, one reduction over the vocabulary per sibling (``walk_sampled`` says
why that suffices) and the residual once; whatever the tree's size, out come
``[rows, depth + 1]`` integers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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

    @staticmethod
    def host_arrays(trees: list[DraftTree], draft_ids: list[list[int]], q_row_of: list[list[int]],
                    width: int) -> np.ndarray:
        """The rows' trees padded to ``width`` nodes and to the widest branching C, as one
        host array [R, 3 * width + width * C]: tokens, draft ids, q rows, children."""
        r = len(trees)
        tokens = np.zeros((r, width), dtype=np.int64)
        ids = np.zeros((r, width), dtype=np.int64)
        q_row = np.full((r, width), -1, dtype=np.int64)
        parents = np.full((r, width), -1, dtype=np.int64)
        for j, t in enumerate(trees):
            k = t.num_nodes
            tokens[j, :k] = t.tokens
            ids[j, :k] = draft_ids[j]
            q_row[j, :k] = q_row_of[j]
            parents[j, 1:k] = t.parents[1:]
        ids[:, 0] = 0  # the root's -1 is never read
        # a child's rank among its siblings: the earlier nodes under the same parent
        real = parents >= 0
        earlier = np.tril(np.ones((width, width), dtype=bool), -1)[None]
        rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)
        c = int(rank[real].max()) + 1 if real.any() else 1
        children = np.full((r, width, c), -1, dtype=np.int64)
        row, node = np.nonzero(real)
        children[row, parents[row, node], rank[row, node]] = node
        return np.concatenate([tokens, ids, q_row, children.reshape(r, width * c)], 1)

    @classmethod
    def unpack(cls, packed: torch.Tensor, width: int, depth: int) -> SampledTrees:
        """The device copy of ``host_arrays``' array, and the deepest node of any row."""
        r = packed.shape[0]
        c = (packed.shape[1] - 3 * width) // width
        return cls(packed[:, :width], packed[:, width:2 * width], packed[:, 3 * width:].view(r, width, c),
                   packed[:, 2 * width:3 * width], depth)

    @classmethod
    def pad(cls, trees: list[DraftTree], draft_ids: list[list[int]], q_row_of: list[list[int]],
            width: int, device: torch.device) -> SampledTrees:
        """The rows' trees padded to ``width`` nodes and to the widest branching, on ``device``."""
        packed = torch.as_tensor(cls.host_arrays(trees, draft_ids, q_row_of, width)).to(device)
        return cls.unpack(packed, width, max(t.depth for t in trees))


def branching(tree: DraftTree) -> int:
    """The most children any node of ``tree`` has (at least 1)."""
    return max([len(ch) for ch in tree.children] + [1])


@torch.no_grad()
def walk_sampled(
    logits: torch.Tensor,        # [B, K, V] target logits at every node of the step's rows
    rows: torch.Tensor,          # [R] the T > 0 rows' batch rows in ``logits``
    temperature: torch.Tensor,   # [R]
    top_p: torch.Tensor | None,  # [R] (None: 1 for every row)
    trees: SampledTrees,
    q_rows: torch.Tensor,        # [Q, Vd] float32 drafting weights
    q_totals: torch.Tensor,      # [Q] float64 their totals: q = row / total, as drawn
    draft_to_target: torch.Tensor | None,  # [Vd] token id of each draft index
    accept_u: torch.Tensor,      # [R, depth + 1, C] uniforms for the sibling tests
    final_u: torch.Tensor,       # [R] uniforms for the last token
    level: Callable | None = None,  # ``walk_level`` or a compiled copy of it (None: ``walk_level``)
) -> torch.Tensor:
    """Returns [R, depth + 1] long: the accepted nodes, root to leaf (-1 after the
    last), then the token drawn at the last accepted node. Each depth is one call of
    ``level`` (``walk_level``), the same computation whatever the depth: compiled, it
    is one graph per branching C."""
    level = level or walk_level
    r = rows.shape[0]
    dev = logits.device
    ar = torch.arange(r, device=dev)
    cur = torch.zeros(r, dtype=torch.long, device=dev)
    active = torch.ones(r, dtype=torch.bool, device=dev)
    path = torch.full((r, trees.depth + 1), -1, dtype=torch.long, device=dev)
    p_last = None
    for d in range(trees.depth + 1):
        taken, stop, residual = level(logits[rows, cur], temperature, top_p, q_rows, q_totals, draft_to_target,
                                      trees.q_row[ar, cur], trees.children[ar, cur], trees.draft_ids, active,
                                      accept_u[:, d])
        p_last = residual if p_last is None else torch.where(stop[:, None], residual, p_last)
        active = active & (taken >= 0)
        path[:, d] = torch.where(active, taken, -1)
        cur = torch.where(active, taken, cur)
    path[:, trees.depth] = sample_rows(p_last, final_u)
    return path


def walk_level(
    node_logits: torch.Tensor,   # [R, V] the target's logits at each row's current node
    temperature: torch.Tensor,   # [R]
    top_p: torch.Tensor | None,  # [R] (None: 1 for every row)
    q_rows: torch.Tensor | None,  # [Q, Vd] float32 drafting weights
    q_totals: torch.Tensor | None,  # [Q] float64 their totals
    draft_to_target: torch.Tensor | None,  # [Vd]
    qi: torch.Tensor,            # [R] the row of ``q_rows`` the current node's children came from (-1: none)
    children: torch.Tensor,      # [R, C] the current node's children in draw order (-1: none)
    draft_ids: torch.Tensor,     # [R, K] every node's draft-vocabulary index
    active: torch.Tensor,        # [R] bool: the row's walk goes on at this depth
    u: torch.Tensor,             # [R, C] uniforms for the sibling tests
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One depth of the walk for every row: (taken [R], the accepted child or -1; stop
    [R], the rows that end here; residual [R, V], the distribution their last token is
    drawn from).

    The residuals are never materialised per sibling. With p_0 the target distribution
    at the node and q the drafting distribution, every token v not yet drawn has the
    unnormalised residual P(v) = max(p_0(v) - a q(v), 0) after any number of
    rejections (subtracting non-negative multiples of q one after another, clamping
    each time, is subtracting their sum once), and a drawn token keeps the value it had
    when it was drawn. So a row carries a few numbers per sibling: the coefficient
    ``a``, the normaliser N = sum P (one reduction over the vocabulary per rejection),
    the drawn tokens' p_0, q and frozen values, and the mass drawn so far."""
    r = node_logits.shape[0]
    dev = node_logits.device
    f64 = torch.float64
    ar = torch.arange(r, device=dev)
    p0 = target_probs_rows(node_logits, temperature, top_p)               # [R, V] float64
    taken = torch.full((r,), -1, dtype=torch.long, device=dev)
    if q_rows is None:
        return taken, active.clone(), p0
    qc = qi.clamp(min=0)
    q = q_rows[qc].to(f64)                                                 # [R, Vd], q = row / total
    inv_total = 1.0 / q_totals[qc]
    pd = p0 if draft_to_target is None else p0[:, draft_to_target]         # p_0 of draft tokens
    outside = None if draft_to_target is None else p0.sum(-1) - pd.sum(-1)  # never reduced
    a = torch.zeros(r, dtype=f64, device=dev)      # the residual's coefficient (q raw)
    norm = torch.ones(r, dtype=f64, device=dev)    # N = sum of the residual
    mass = torch.zeros(r, dtype=f64, device=dev)   # q mass of the drawn siblings
    drawn: list[tuple[torch.Tensor, ...]] = []     # (x, p_0(x), q(x), frozen P(x), drawn?)
    for j in range(children.shape[1]):
        child = children[:, j]
        live = active & (taken < 0) & (child >= 0) & (qi >= 0)
        c = child.clamp(min=0)
        xd = draft_ids[ar, c]
        px = pd.gather(1, xd[:, None])[:, 0]                                   # p_0(x)
        qx = q.gather(1, xd[:, None])[:, 0]                                    # raw q(x)
        scale = torch.where(mass < 1, 1.0 / (1.0 - mass).clamp(min=1e-300), 0.0)
        qj = qx * inv_total * scale                                            # q_j(x)
        pj = (px - a * qx).clamp(min=0.0)                                      # N * p_j(x)
        ok = live & (qj > 0) & (u[:, j] * qj * norm < pj)
        taken = torch.where(ok, child, taken)
        rej = live & ~ok
        # p_{j+1} = norm(max(p_j - q_j, 0)): a grows by N_j * s_j / total
        a_new = a + norm * scale * inv_total
        s_new = torch.addcmul(pd, a_new[:, None], q, value=-1.0).clamp_(min=0.0).sum(-1)
        if outside is not None:
            s_new = s_new + outside
        for _, dpx, dqx, dfz, dlive in drawn:  # drawn tokens keep their frozen values
            s_new = s_new + torch.where(dlive, dfz - (dpx - a_new * dqx).clamp(min=0.0), 0.0)
        step = rej & (s_new > 0)            # a residual of mass 0 leaves p as it was
        a = torch.where(step, a_new, a)
        norm = torch.where(step, s_new, norm)
        drawn.append((xd, px, qx, (px - a * qx).clamp(min=0.0), rej))
        mass = torch.where(rej, mass + qx * inv_total, mass)
    stop = active & (taken < 0)
    residual = torch.addcmul(pd, a[:, None], q, value=-1.0).clamp_(min=0.0)   # [R, Vd]
    for dx, _, _, dfz, dlive in drawn:
        at = residual.gather(1, dx[:, None])
        residual.scatter_(1, dx[:, None], torch.where(dlive[:, None], dfz[:, None], at))
    if draft_to_target is not None:
        full = p0.clone()
        full[:, draft_to_target] = residual
        residual = full
    return taken, stop, residual

"""Drafting on the model's device: one batched call per depth wave, small numbers out.

A round's trees are grown in waves (``treespark.spec.select``). Each wave gathers every
node that some running request opens, and ``score_parents`` scores all of them in one
call on the drafter's device:

    logits = U[row, depth] + W2 . W1[parent]      (the Markov head, over the draft vocabulary)
    q      = softmax(logits / T)                  (T = 1 to rank at T = 0)

and returns, per parent, the ``TOP_M`` largest q with their indices and, at T > 0,
``k`` draws without replacement: sequential inverse-CDF draws on the cumulative q in
float64, one uniform each from the request's own generator, so a seeded request draws
the same tokens on any device; for a reproducible request, the Gumbel-top-k of
log q + G with the noise keyed by the children's index (``treespark.spec.gumbel``), the
noise its target tokens are verified with. Only ``[parents, 2 * TOP_M + 2k]`` numbers
reach the host, in one copy; the other T > 0 parents' q rows stay on the device for
verification (``treespark.spec.walk``).

Where every row of a round is at T = 0 and the base logits are on the CPU, the whole
round (every wave's ranking, scoring and slots) runs in one native call instead
(``treespark.spec.native_forest``): the same trees, without ~1 ms of operators a wave.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from treespark.kernels import vocab
from treespark.kernels.linear import SMALL_ROWS, unplanned_linear
from treespark.kernels.transfer import HostTransfers
from treespark.spec import native_forest
from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration
from treespark.spec.forest import Forest
from treespark.spec.gumbel import PositionKey, keyed_top_k, position_keys
from treespark.spec.sampling import Sampler
from treespark.spec.select import TOP_M, SlotArrays, slot_table
from treespark.spec.tree import DraftTree


def draw_without_replacement(c: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential draws without replacement by inverse CDF.

    c: [S, Vd] float64 cumulative sums of the drawing weights (not normalised: its last
    column is the total); u: [S, k] uniforms in [0, 1). Token x owns the interval
    [c[x-1], c[x]); draw j finds u_j * (mass left) with the drawn tokens' intervals
    skipped. Returns ids [S, k] and their probabilities (interval / total) [S, k],
    0 where a row ran out of support."""
    s, vd = c.shape
    total = c[:, -1]
    ids: list[torch.Tensor] = []
    widths: list[torch.Tensor] = []
    mass = torch.zeros(s, dtype=c.dtype, device=c.device)
    for j in range(u.shape[1]):
        t = u[:, j] * (total - mass)
        if ids:
            prev, wprev = torch.stack(ids, 1), torch.stack(widths, 1)  # [S, j]
            order = prev.argsort(1)
            prev, wprev = prev.gather(1, order), wprev.gather(1, order)
            start = c.gather(1, prev) - wprev                            # each drawn token's interval start
            for i in range(j):                                           # ascending: skip what lies before t
                t = torch.where(start[:, i] <= t, t + wprev[:, i], t)
        x = torch.searchsorted(c, t[:, None], right=True)[:, 0].clamp(max=vd - 1)
        below = torch.where(x > 0, c.gather(1, (x - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        w = c.gather(1, x[:, None])[:, 0] - below
        ids.append(x)
        widths.append(w)
        mass = mass + w
    return torch.stack(ids, 1), torch.stack(widths, 1) / total[:, None]


@torch.no_grad()
def score_parents(
    base: torch.Tensor,       # [B, block, Vd] the drafter's base logits U
    w1: torch.Tensor,         # [V, r] Markov W1 (rows by parent token id)
    w2: torch.Tensor,         # [Vd, r] Markov W2
    rows: torch.Tensor,       # [P] batch row of each parent
    depths: torch.Tensor,     # [P] depth of the children (1-based)
    parents: torch.Tensor,    # [P] parent token ids
    temperature: torch.Tensor | None,  # [P] T (1 for T = 0, which ranks at T = 1); None: 1 for all
    sampled: torch.Tensor,    # [S] indices (into P) of the parents drawn at T > 0 by their uniforms
    uniforms: torch.Tensor,   # [S, k] float64
    keyed: torch.Tensor,      # [G] indices (into P) of the reproducible rows' parents
    keys: torch.Tensor,       # [G, 2] int64 their ``position_keys`` (at the children's index)
    key_tokens: torch.Tensor,  # [Vd] int64 the token id of each draft index (the noise's)
    w2_half: torch.Tensor | None = None,  # W2's exact bfloat16 panels, where they hold it (``Linear.panels``)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score one wave's parents. Returns (packed [P, 2M + 2k] float64, q rows [S, Vd]
    float32 and their float64 totals [S] for the sampled parents): packed holds the
    top-M q, their indices, then the k drawn indices and their q (zeros for T = 0
    parents). The q that tokens are drawn from, and verified against, is a row over
    its total (one cumulative sum in float64, taken while converting). Passes over the
    vocabulary per parent: the product, the base, top-M, the shift (and the temperature),
    one exp-and-sum; a sampled parent adds its row of q and the cumulative sum, a keyed
    one its noise and top-k."""
    k = uniforms.shape[1]
    x = w1[parents]                                                  # [P, r]
    fp32 = x.dtype == w2.dtype == torch.float32
    # each parent's row of the base: one gather of whole rows (index_select copies a [P, Vd]
    # row set at about twice the speed of the advanced index base[rows, depths - 1] on CPU)
    parent_base = base.reshape(-1, base.shape[-1]).index_select(0, rows * base.shape[1] + depths - 1)  # fresh
    if fp32 and (x.shape[0] > SMALL_ROWS or x.device.type != "cpu"):  # the base, then += x W2^T in the product
        logits = parent_base.float().addmm_(x, w2.t())
    else:                                                            # CPU, few rows: the fast layout
        logits = unplanned_linear(x, w2, half=w2_half).float()
        logits += parent_base                                        # [P, Vd], in place
    # q = softmax((logits - max) / T), never materialised except for the sampled parents'
    # rows, which are drawn from: the top-M of q are the top-M of the logits (T > 0), and
    # shifting first makes a tiny temperature give -inf, not NaN, off the argmax
    m = min(TOP_M, logits.shape[-1])
    top = vocab.topk(logits, m)
    top_scaled = top.values - top.values[:, :1]                      # [P, M]
    scaled = logits.sub_(top.values[:, :1])
    if temperature is not None:
        scaled.div_(temperature[:, None])
        top_scaled = top_scaled / temperature[:, None]
    # the keyed parents' children: Gumbel-top-k of log q (up to a constant), before the exp
    keyed_ids = keyed_top_k(scaled[keyed], keys, key_tokens, k) if keyed.numel() else None   # [G, k]
    e = scaled.exp_()                                                # in place: no second [P, Vd]
    total = e.sum(-1, keepdim=True)                                  # [P, 1]
    top_q = (top_scaled - total.log()).exp_()
    drawn = torch.zeros(scaled.shape[0], 2 * k, dtype=torch.float64, device=scaled.device)
    totals = torch.zeros(0, dtype=torch.float64, device=scaled.device)
    rows_s = scaled.new_zeros(0, scaled.shape[-1])
    if sampled.numel():
        rows_s = e[sampled].div_(total[sampled])                     # [S, Vd] float32
        c = torch.cumsum(rows_s, -1, dtype=torch.float64)
        ids, qx = draw_without_replacement(c, uniforms)
        totals = c[:, -1]
        drawn[sampled] = torch.cat([ids.to(torch.float64), qx], dim=1)
    if keyed_ids is not None:
        qx = e[keyed].gather(1, keyed_ids).to(torch.float64) / total[keyed].to(torch.float64)
        drawn[keyed] = torch.cat([keyed_ids.to(torch.float64), qx], dim=1)
    packed = torch.cat([top_q.to(torch.float64), top.indices.to(torch.float64), drawn], dim=1)
    return packed, rows_s, totals


def best_nodes(scores: list[float], count: int) -> list[int]:
    """The root and the ``count`` best draft nodes by (score desc, index), in node order
    (``scores[j]`` is node ``j + 1``'s)."""
    if count >= len(scores):
        return list(range(len(scores) + 1))
    best = sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:count]
    return [0, *sorted(j + 1 for j in best)]


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """``tree`` restricted to the nodes ``keep`` (node order, root first, each with its parent)."""
    index = {0: 0}
    cut = DraftTree.root_only(tree.tokens[0])
    for n in keep[1:]:
        assert tree.parents[n] in index, "a cut tree keeps every kept node's parent"
        index[n] = cut.add(index[tree.parents[n]], tree.tokens[n], q=tree.q[n], survival=tree.survival[n])
    cut.draft_to_target = tree.draft_to_target
    cut.child_q = {index[n]: q for n, q in tree.child_q.items() if n in index and cut.children[index[n]]}
    return cut


@dataclass
class RoundDraft:
    """A round's trees, and what verification needs of the drafting on the device."""

    trees: list[DraftTree]
    q_rows: torch.Tensor | None = None   # [R, Vd] float32: the drawing weights of T > 0 parents
    q_totals: torch.Tensor | None = None  # [R] float64: each row's total (q = row / total)
    # per tree, per node: the row of q_rows its children were drawn from (-1: none)
    q_row_of: list[list[int]] = field(default_factory=list)
    draft_ids: list[list[int]] = field(default_factory=list)  # per tree, per node: its draft index
    # per tree, per draft node (node 1 first): its score (``treespark.spec.select``), known before its draw
    scores: list[list[float]] = field(default_factory=list)
    waves: int = 0

    @classmethod
    def roots(cls, roots: list[int]) -> RoundDraft:
        """A round in which no row drafts: each tree its root alone (what ``WaveDrafter.draft``
        makes of it, without a forest)."""
        return cls(trees=[DraftTree.root_only(t) for t in roots], q_row_of=[[-1] for _ in roots],
                   draft_ids=[[-1] for _ in roots], scores=[[] for _ in roots])

    def trimmed(self, counts: list[int]) -> RoundDraft:
        """Each tree cut to its ``counts[i]`` best nodes by (score desc, index): a
        prefix-closed set (scores never rise to a child or a later sibling), so each
        cut tree is a tree, verified exactly like a smaller budget's draft."""
        out = RoundDraft(trees=[], q_rows=self.q_rows, q_totals=self.q_totals, waves=self.waves)
        for i, (tree, c) in enumerate(zip(self.trees, counts, strict=True)):
            sc = self.scores[i]
            keep = best_nodes(sc, c)
            cut = subtree(tree, keep)
            out.trees.append(cut)
            out.q_row_of.append([self.q_row_of[i][n] for n in keep])
            out.draft_ids.append([self.draft_ids[i][n] for n in keep])
            out.scores.append([sc[n - 1] for n in keep[1:]])
        return out


@dataclass(frozen=True)
class RowDraft:
    """What one running request brings to a round."""

    root: int
    budget: Budget
    depth_limit: int
    temperature: float             # the drafting temperature (``Calibration.draft_temperature``; 0: rank)
    calibration: Calibration       # the map in force at the request's temperature
    sampler: Sampler
    key: PositionKey | None = None  # a reproducible T > 0 row's noise (None: drawn by ``sampler``)

    def __post_init__(self) -> None:
        assert self.key is None or self.temperature > 0, "a keyed row is sampled"


class WaveDrafter:
    """Grows a batch's trees on the drafter's device (see the module docstring)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, draft_to_target: torch.Tensor | None,
                 transfers: HostTransfers, w2_panels: Callable[[], torch.Tensor | None] = lambda: None,
                 *, native: bool = True) -> None:
        """``w2_panels``: W2's exact bfloat16 panels as they stand (``Linear.panels``: a drafter
        stored in bfloat16, half the bytes a wave on the CPU), or None. ``native``: grow a
        round whose rows are all at T = 0 in one native call where the drafter's numbers
        are on the CPU (``treespark.spec.native_forest``); False: always in waves here."""
        self.w1, self.w2, self.w2_panels = w1, w2, w2_panels
        # (W1, W2's panels) float32 for the native rounds, made here, not in a step
        self._native_w = (w1.detach().float().contiguous(), native_forest.panels(w2)) \
            if native and w2.device.type == "cpu" and native_forest.available(w2) else None
        self.d2t = None if draft_to_target is None else draft_to_target.cpu().numpy()
        self.vocab = w2.shape[0]
        # the token id of each draft index, on the device: whose noise a keyed draft takes
        self.key_tokens = torch.arange(self.vocab, device=w2.device) if draft_to_target is None \
            else draft_to_target.to(w2.device, torch.long)
        self.transfers = transfers
        self._no_keys = torch.zeros(0, 2, dtype=torch.long, device=w2.device)   # a wave without keyed rows

    def _greedy_natively(self, base: torch.Tensor, rows: list[RowDraft]) -> bool:
        return (self._native_w is not None and base.device.type == "cpu"
                and all(r.temperature == 0 for r in rows))

    def draft(self, base: torch.Tensor, rows: list[RowDraft]) -> RoundDraft:
        start = ([r.root for r in rows], [r.budget for r in rows], [r.depth_limit for r in rows], self.d2t)
        out = RoundDraft(trees=[])
        if self._greedy_natively(base, rows):
            forest, out.waves, trees, keeps = native_forest.greedy_forest(*start, base, *self._native_w,
                                                                          [r.calibration for r in rows])
            return _finished(out, forest, trees, keeps, None)
        forest = Forest(*start)
        temp = np.array([r.temperature for r in rows], dtype=np.float64)         # [R]
        cap = np.array([r.budget.branch_cap for r in rows], dtype=np.int64)      # [R]
        is_keyed = np.array([r.key is not None for r in rows], dtype=bool)      # [R]
        # [R, 3] a keyed row's seed words and the index of its next token (0 elsewhere)
        coords = np.array([(r.key.seed_lo, r.key.seed_hi, r.key.next_index) if r.key is not None else (0, 0, 0)
                           for r in rows], dtype=np.int64).reshape(len(rows), 3)
        # rows that share a map, a regime and a branch cap get their slots in one array call
        group_of: dict[tuple[int, bool, int], int] = {}
        group = np.array([group_of.setdefault((id(r.calibration), r.temperature > 0, r.budget.branch_cap),
                                              len(group_of)) for r in rows], dtype=np.int64)
        q_row = np.full(forest.parent.shape, -1, dtype=np.int64)                 # [R, C] grows with the forest
        chunks: list[torch.Tensor] = []
        total_chunks: list[torch.Tensor] = []
        n_rows = 0
        while True:
            opens_b, opens_n = forest.to_open()
            if not len(opens_b):
                break
            out.waves += 1
            p = len(opens_b)
            k = int(cap[opens_b].max())
            sampled = np.flatnonzero((temp[opens_b] > 0) & ~is_keyed[opens_b])
            keyed = np.flatnonzero(is_keyed[opens_b])
            # each parent draws its own branch_cap uniforms (padding unused), so what a
            # request draws never depends on who shares its batch; a row's parents draw
            # in one call, in their order (the same numbers as one call a parent)
            u = np.full((len(sampled), k), 0.5)
            sampled_rows = opens_b[sampled]
            for b in np.unique(sampled_rows).tolist():
                mine = np.flatnonzero(sampled_rows == b)
                c = rows[b].budget.branch_cap
                u[mine, :c] = np.asarray(rows[b].sampler.uniform(len(mine) * c)).reshape(len(mine), c)
            # one upload: per parent (row, depth, token, temperature), the sampled parents, their
            # uniforms, the keyed parents and their (seed words, children's index); integers
            # below 2**53 are exact in float64
            t = temp[opens_b]
            depth = forest.depth[opens_b, opens_n]
            host = np.stack([opens_b, depth + 1, forest.token[opens_b, opens_n],
                             np.where(t > 0, t, 1.0)], 1).astype(np.float64)
            s, g = len(sampled), len(keyed)
            at_key = coords[opens_b[keyed]]                              # [G, 3] (a copy)
            at_key[:, 2] += depth[keyed]                                 # the children's index
            up = self.transfers.upload(np.concatenate([host.ravel(), sampled.astype(np.float64), u.ravel(),
                                                       keyed.astype(np.float64), at_key.ravel()]), torch.float64)
            dev_host = up[:4 * p].view(p, 4)
            o = 4 * p + s + s * k
            dev_keys = up[o + g:].view(g, 3).long()
            unit = bool(np.all((t <= 0) | (t == 1)))
            packed, q_rows, totals = score_parents(
                base, self.w1, self.w2, dev_host[:, 0].long(), dev_host[:, 1].long(),
                dev_host[:, 2].long(), None if unit else dev_host[:, 3].float().clamp(min=1e-30),  # > 0 in fp32
                up[4 * p:4 * p + s].long(), up[4 * p + s:o].view(s, k), up[o:o + g].long(),
                position_keys(dev_keys[:, 0], dev_keys[:, 1], dev_keys[:, 2]) if g else self._no_keys,
                self.key_tokens, self.w2_panels())
            if s:
                chunks.append(q_rows)
                total_chunks.append(totals)
            values = self.transfers.fetch(packed).numpy()
            m = (values.shape[1] - 2 * k) // 2
            top_q, top_ids = values[:, :m], values[:, m:2 * m].astype(np.int64)
            drawn_ids, drawn_q = values[:, 2 * m:2 * m + k].astype(np.int64), values[:, 2 * m + k:]
            # the slots of every parent, one array computation per (map, regime, branch cap)
            slots = SlotArrays.empty(p, k)
            for g in np.unique(group[opens_b]).tolist():
                sel = np.flatnonzero(group[opens_b] == g)
                r = rows[opens_b[sel[0]]]
                drawn = r.temperature > 0
                slots.put(sel, slot_table(top_q[sel], top_ids[sel], drawn_ids[sel] if drawn else None,
                                          drawn_q[sel] if drawn else None, r.calibration, r.budget.branch_cap,
                                          self.vocab))
            forest.open(opens_b, opens_n, slots)
            if q_row.shape[1] < forest.parent.shape[1]:
                q_row = np.pad(q_row, ((0, 0), (0, forest.parent.shape[1] - q_row.shape[1])), constant_values=-1)
            q_row[opens_b[sampled], opens_n[sampled]] = n_rows + np.arange(s)
            n_rows += s
        if chunks:
            out.q_rows, out.q_totals = torch.cat(chunks), torch.cat(total_chunks)
        return _finished(out, forest, *forest.finish(), q_row)


def _finished(out: RoundDraft, forest: Forest, trees: list[DraftTree], keeps: list[np.ndarray],
              q_row: np.ndarray | None) -> RoundDraft:
    """``out`` with ``forest``'s trees (``Forest.finish``'s), each node's q row (``q_row``
    [R, C]: -1 for none; None: none at all), draft index and score."""
    for b, keep in enumerate(keeps):
        out.trees.append(trees[b])
        out.q_row_of.append([-1] * len(keep) if q_row is None else q_row[b, keep].tolist())
        out.draft_ids.append(forest.draft_id[b, keep].tolist())
        out.scores.append(forest.score[b, keep[1:]].tolist())
    return out

"""A round's draft trees for a whole batch, selected as array operations.

``Forest`` applies ``treespark.spec.select``'s rule to every row of a round at once:
each row's candidates live in arrays ``[rows, candidates]`` (candidate 0 is the root;
a candidate's index is its creation order), a wave's opened nodes come back as index
arrays, and their children are written in one scatter. It builds exactly the trees
``TreeBuilder`` builds one request at a time (the same candidates, indices, scores,
kept sets and order; ties to the earlier candidate), so the losslessness arguments of
``treespark.spec.select`` carry over unchanged.

Terms as in ``treespark.spec.select``: a slot's score is the running minimum

    score(n, j) = min(min(score(n), survival(n)), min_{i <= j} survival(n) * e(n, i))

and a row keeps the root and its ``node_cap`` best candidates scoring >= theta, by a
stable sort on -score (ties: the lower index).
"""

from __future__ import annotations

import numpy as np

from treespark.spec.budget import Budget
from treespark.spec.select import SlotArrays
from treespark.spec.tree import DraftTree

# a row's per-candidate arrays: the value an unused column holds, and the dtype
_ARRAYS = {"parent": (-1, np.int64), "draft_id": (-1, np.int64), "token": (0, np.int64), "q": (1.0, np.float64),
           "score": (1.0, np.float64), "survival": (1.0, np.float64), "depth": (0, np.int64), "opened": (False, bool)}


class Forest:
    """The candidates of every row's tree for one round (see the module docstring).

    roots: [R] root token ids; budgets: one per row; depth_limits: [R] the deepest node
    a row may hold; draft_to_target: draft index -> token id (None: identity); room: the
    candidates a row has room for at the start (None: a starting width the arrays grow
    past as waves need; a native grower writes in place, so it is given room for every
    node a round can open, ``whole_round``)."""

    def __init__(self, roots: list[int], budgets: list[Budget], depth_limits: list[int],
                 draft_to_target: np.ndarray | None = None, room: int | None = None) -> None:
        r = len(roots)
        assert len(budgets) == len(depth_limits) == r
        self.theta = np.array([b.theta for b in budgets], dtype=np.float64)          # [R]
        self.node_cap = np.array([b.node_cap for b in budgets], dtype=np.int64)      # [R]
        self.depth_limit = np.asarray(depth_limits, dtype=np.int64)                  # [R]
        self.speculates = np.array([not b.is_off for b in budgets], dtype=bool) & (self.depth_limit > 0)
        self.d2t = draft_to_target
        # a starting width: a node opened and later pushed out of the top keeps its
        # children as candidates, so a row may outgrow it (``_grow``)
        branch = max((b.branch_cap for b in budgets), default=1)
        cap = 1 + (int(self.node_cap.max(initial=0)) + 1) * branch if room is None else max(room, 1)
        self.size = np.ones(r, dtype=np.int64)                   # [R] candidates per row
        for name, (fill, dtype) in _ARRAYS.items():              # [R, C] each
            setattr(self, name, np.full((r, cap), fill, dtype=dtype))
        self.token[:, 0] = roots

    @property
    def rows(self) -> int:
        return len(self.size)

    @staticmethod
    def whole_round(budgets: list[Budget], depth_limits: list[int]) -> int:
        """The most candidates a row of a round can hold: each node opens in the wave after
        it is made or never, so at most ``depth`` waves of ``node_cap + 1`` nodes open,
        ``branch_cap`` children each (a node opened and later pushed out of the top keeps
        its children)."""
        depth = max(depth_limits, default=0)
        return 1 + depth * (max((b.node_cap for b in budgets), default=0) + 1) * \
            max((b.branch_cap for b in budgets), default=1)

    def _grow(self, need: int) -> None:
        cap = self.parent.shape[1]
        if need <= cap:
            return
        extra = max(need, 2 * cap) - cap
        for name, (fill, _) in _ARRAYS.items():
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.full((a.shape[0], extra), fill, dtype=a.dtype)], 1))

    def ranked(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's candidates best first, and how many of them it keeps: order [R, C]
        (a stable sort on -score, the root and candidates under theta last) and [R]."""
        cols = np.arange(self.parent.shape[1])[None]
        eligible = (cols > 0) & (cols < self.size[:, None]) & (self.score >= self.theta[:, None])
        order = np.argsort(np.where(eligible, -self.score, np.inf), axis=1, kind="stable")
        return order, np.minimum(eligible.sum(1), self.node_cap)

    def to_open(self) -> tuple[np.ndarray, np.ndarray]:
        """The (row, node) pairs of the next wave, rows ascending and each row's nodes in
        kept order: kept nodes, not yet opened, one of whose children could still be kept."""
        order, n_top = self.ranked()
        r, c = order.shape
        kept_order = np.concatenate([np.zeros((r, 1), dtype=np.int64), order[:, :c - 1]], 1)   # [R, C]
        in_kept = np.arange(c)[None] <= n_top[:, None]
        full = n_top >= self.node_cap
        last = np.take_along_axis(order, np.maximum(n_top - 1, 0)[:, None], 1)[:, 0]
        floor = np.where(full, self.score[np.arange(r), last], -np.inf)                  # [R]
        bound = np.minimum(self.score, self.survival)                                     # [R, C]
        ok = (~self.opened & (self.depth < self.depth_limit[:, None]) & (bound >= self.theta[:, None])
              & (~full[:, None] | (bound > floor[:, None])) & self.speculates[:, None])
        pick = in_kept & np.take_along_axis(ok, kept_order, 1)
        rows, j = np.nonzero(pick)
        return rows, kept_order[rows, j]

    def open(self, rows: np.ndarray, nodes: np.ndarray, slots: SlotArrays) -> None:
        """Add the children ``slots`` offers under each (row, node) as candidates: the
        pairs as ``to_open`` gave them (a row's children are numbered in that order)."""
        if len(rows) == 0:
            return
        assert np.all(np.diff(rows) >= 0), "pairs come grouped by row"
        assert not self.opened[rows, nodes].any(), "a node is opened once"
        self.opened[rows, nodes] = True
        k = slots.ids.shape[1]
        count = slots.count
        valid = np.arange(k)[None] < count[:, None]                                        # [P, k]
        surv = self.survival[rows, nodes]                                                  # [P]
        bound = np.minimum(self.score[rows, nodes], surv)
        s = np.where(valid, surv[:, None] * slots.expected, np.inf)
        score = np.minimum.accumulate(np.minimum(bound[:, None], s), axis=1)               # [P, k]
        # each pair's first child index: the row's size, then its earlier pairs' slots
        before = np.cumsum(count) - count
        first_of_row = np.searchsorted(rows, rows, side="left")
        base = self.size[rows] + before - before[first_of_row]                             # [P]
        self._grow(int((base + count).max()))
        p, j = np.nonzero(valid)
        row, at = rows[p], base[p] + j
        ids = slots.ids[p, j]
        self.parent[row, at] = nodes[p]
        self.draft_id[row, at] = ids
        self.token[row, at] = ids if self.d2t is None else self.d2t[ids]
        self.q[row, at] = slots.q[p, j]
        self.score[row, at] = score[p, j]
        self.survival[row, at] = surv[p] * slots.realized[p, j]
        self.depth[row, at] = self.depth[rows, nodes][p] + 1
        self.size += np.bincount(rows, weights=count, minlength=self.rows).astype(np.int64)

    def kept(self) -> np.ndarray:
        """[R, C] bool: the root and each row's kept candidates."""
        order, n_top = self.ranked()
        r, c = order.shape
        mask = np.zeros((r, c), dtype=bool)
        top = np.arange(c)[None] < n_top[:, None]
        mask[np.nonzero(top)[0], order[top]] = True
        mask[:, 0] = True
        return mask

    def finish(self) -> tuple[list[DraftTree], list[np.ndarray]]:
        """Each row's tree, and for each of its nodes the candidate it came from
        (creation order: parents before children, siblings in rank order)."""
        mask = self.kept()
        index = np.cumsum(mask, 1) - 1                                   # candidate -> tree node
        parents = np.where(mask, np.take_along_axis(index, np.maximum(self.parent, 0), 1), -1)
        parents[:, 0] = -1
        keeps = [np.flatnonzero(mask[b]) for b in range(self.rows)]
        return self.trees(keeps, [parents[b, keep] for b, keep in enumerate(keeps)]), keeps

    def trees(self, keeps: list[np.ndarray], parents: list[np.ndarray]) -> list[DraftTree]:
        """Each row's tree of the candidates ``keeps[b]`` (creation order), node i's parent
        the node ``parents[b][i]`` (-1 for the root): what ``finish`` chose, or a native
        grower by the same rule."""
        return [DraftTree.from_arrays(self.token[b, keep], parents[b], self.depth[b, keep], self.q[b, keep],
                                      self.survival[b, keep]) for b, keep in enumerate(keeps)]

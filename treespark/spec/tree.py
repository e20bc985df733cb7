"""The draft tree: flat arrays, a root, and the tensors the target needs to verify it.

Node 0 is the *root*: the last emitted token, which the target has not processed yet.
Every other node ``i`` is a draft token with a parent ``parents[i] < i`` (nodes are
appended after their parents), a depth ``depths[i] = depths[parent] + 1``, the
drafter probability ``q[i]`` of its token under the distribution it was drawn from,
and its calibrated path survival ``survival[i]`` = P(node i is accepted).
Children are kept in draw order: verification visits siblings in that order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q: list[float]
    survival: list[float]
    children: list[list[int]]
    # parent node -> the distribution its children were drawn from, over the drafter's
    # vocabulary (``draft_to_target`` maps its indices to token ids; None = identity)
    child_q: dict[int, torch.Tensor] = field(default_factory=dict)
    draft_to_target: torch.Tensor | None = None

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        return cls(tokens=[root_token], parents=[-1], depths=[0], q=[1.0], survival=[1.0], children=[[]])

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, q: np.ndarray,
                    survival: np.ndarray) -> DraftTree:
        """A tree from its flat arrays [N] (node 0 the root, parent -1; ``parents[i] < i``),
        children in node order, as ``add`` would build it node by node."""
        par = parents.tolist()
        assert par[0] == -1, "node 0 is the root"
        children: list[list[int]] = [[] for _ in par]
        for i, p in enumerate(par[1:], 1):
            assert 0 <= p < i, "parents precede children"
            children[p].append(i)
        return cls(tokens=tokens.tolist(), parents=par, depths=depths.tolist(), q=q.tolist(),
                   survival=survival.tolist(), children=children)

    def add(self, parent: int, token: int, q: float, survival: float) -> int:
        assert 0 <= parent < len(self.tokens), "parent must already be in the tree"
        i = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.q.append(float(q))
        self.survival.append(float(survival))
        self.children.append([])
        self.children[parent].append(i)
        return i

    # -- shape statistics --------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Tokens verified in one round: the root plus the draft nodes."""
        return len(self.tokens)

    @property
    def size(self) -> int:
        """Draft nodes, the root excluded (0 for plain decoding)."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def width(self) -> int:
        """The most draft nodes at one depth (1 for a chain, 0 for an empty tree)."""
        if self.size == 0:
            return 0
        counts: dict[int, int] = {}
        for d in self.depths[1:]:
            counts[d] = counts.get(d, 0) + 1
        return max(counts.values())

    # -- tensors for the verify forward -------------------------------------------------
    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True iff node j is node i or one of its ancestors."""
        parents = np.asarray([0, *self.parents[1:]], dtype=np.int64)[None]
        return torch.from_numpy(ancestor_masks(parents, self.depth)[0])

    def position_offsets(self) -> torch.Tensor:
        """[N] long: each node's position relative to the root (its depth)."""
        return torch.tensor(self.depths, dtype=torch.long)

    def child_probs_full(self, node: int, vocab_size: int) -> torch.Tensor:
        """The distribution ``node``'s children were drawn from, over the target vocabulary."""
        qd = self.child_q[node].to(torch.float64)
        if self.draft_to_target is None:
            assert qd.numel() == vocab_size
            return qd
        full = torch.zeros(vocab_size, dtype=torch.float64)
        full[self.draft_to_target] = qd
        return full

    def check(self) -> None:
        """Assert the structural invariants (used by tests and debug runs)."""
        n = self.num_nodes
        assert len(self.parents) == len(self.depths) == len(self.q) == len(self.survival) == n
        assert self.parents[0] == -1 and self.depths[0] == 0
        for i in range(1, n):
            p = self.parents[i]
            assert 0 <= p < i and self.depths[i] == self.depths[p] + 1
            assert i in self.children[p]
            siblings = [self.tokens[c] for c in self.children[p]]
            assert len(set(siblings)) == len(siblings), "siblings must be distinct tokens"


@dataclass(frozen=True)
class TreeBatch:
    """One verify forward's inputs for a batch of trees, each row padded to the largest:
    ``tokens`` / ``positions`` / ``write_pos`` [B, K] and the attention ``mask``
    [B, 1, K, L + K] (row r sees its committed context and its node's tree ancestors)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_pos: torch.Tensor
    mask: torch.Tensor


def padded_arrays(trees: list[DraftTree], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The trees as padded host arrays [B, width]: tokens, parents (padding: the root),
    depths, and each row's node count [B]."""
    n = len(trees)
    tokens = np.zeros((n, width), dtype=np.int64)
    parents = np.zeros((n, width), dtype=np.int64)
    depths = np.zeros((n, width), dtype=np.int64)
    sizes = np.fromiter((t.num_nodes for t in trees), dtype=np.int64, count=n)
    for i, t in enumerate(trees):
        k = t.num_nodes
        tokens[i, :k] = t.tokens
        parents[i, 1:k] = t.parents[1:]
        depths[i, :k] = t.depths
    return tokens, parents, depths, sizes


def ancestor_masks(parents: np.ndarray, depth: int) -> np.ndarray:
    """[B, K, K] bool from parents [B, K] (node 0 the root, padding pointing at it):
    mask[b, i, j] iff node j is node i or one of its ancestors; ``depth`` bounds the
    deepest node, so that many rounds of "my parent's ancestors are mine" settle it."""
    b, k = parents.shape
    eye = np.eye(k, dtype=bool)[None].repeat(b, 0)
    mask = eye.copy()
    rows = np.arange(b)[:, None]
    for _ in range(depth):
        mask = eye | mask[rows, parents]
    return mask


def context_and_tree_mask(tree_mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[B, K, max(lengths) + K] bool on the host: each node's row sees its row's committed
    context (columns below its length) and, over the K tree columns after it, its
    ancestors and itself (``tree_mask`` [B, K, K])."""
    n, k, _ = tree_mask.shape
    total = int(lengths.max()) + k
    mask = np.broadcast_to(np.arange(total)[None, None, :] < lengths[:, None, None], (n, k, total)).copy()
    cols = lengths[:, None] + np.arange(k)[None]                                          # [B, K]
    mask[np.arange(n)[:, None, None], np.arange(k)[None, :, None], cols[:, None, :]] = tree_mask
    return mask


def tree_batch(trees: list[DraftTree], lengths: list[int], device: torch.device,
               upload: Callable[[object, torch.dtype], torch.Tensor] | None = None) -> TreeBatch:
    """The batch of ``trees`` after committed contexts of ``lengths`` tokens: built on the
    host as arrays in the trees' size, moved in two uploads (``upload``: host array ->
    device tensor; default: ``torch.as_tensor`` then ``.to(device)``), widened to the
    context on the device; on a CPU, where an upload is no copy, the whole mask is made
    on the host (``context_and_tree_mask``: a few numpy calls where the device takes ~10
    operators)."""
    upload = upload or (lambda x, dtype: torch.as_tensor(x, dtype=dtype).to(device))
    kmax = max(t.num_nodes for t in trees)
    if kmax == 1:  # every row verifies its root alone (plain decoding): one upload, no tree mask
        ints = upload(np.asarray([[t.tokens[0] for t in trees], lengths], dtype=np.int64).T, torch.long)  # [B, 2]
        tokens_d, lens_d = ints[:, :1], ints[:, 1:]
        cols = torch.arange(max(lengths) + 1, device=device)[None, None, :]   # [1, 1, T]
        return TreeBatch(tokens_d, lens_d, lens_d, (cols <= lens_d[:, :, None])[:, None])
    tokens, parents, depths, sizes = padded_arrays(trees, kmax)
    tree_mask = ancestor_masks(parents, int(depths.max()))
    pad = np.arange(kmax)[None, :] >= sizes[:, None]                     # [B, K] padding nodes
    tree_mask[pad] = False
    tree_mask[pad, 0] = True  # padding rows see the root only (no all-masked rows)
    lens = np.asarray(lengths, dtype=np.int64)[:, None]
    if device.type == "cpu":
        ints = upload(np.concatenate([tokens, lens + depths, lens + np.arange(kmax)[None]], 1), torch.long)  # [B, 3K]
        mask = upload(context_and_tree_mask(tree_mask, lens[:, 0]), torch.bool)
        return TreeBatch(ints[:, :kmax], ints[:, kmax:2 * kmax], ints[:, 2 * kmax:], mask[:, None])
    ints = upload(np.concatenate([tokens, lens + depths, lens], 1), torch.long)   # [B, 2K + 1]
    tokens_d, positions, lens_d = ints[:, :kmax], ints[:, kmax:2 * kmax], ints[:, 2 * kmax:]
    write_pos, mask = widened_on_device(upload(tree_mask, torch.bool), lens_d, max(lengths) + kmax)
    return TreeBatch(tokens_d, positions, write_pos, mask[:, None])


def widened_on_device(tree_mask: torch.Tensor, lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``context_and_tree_mask`` made where ``tree_mask`` [B, K, K] and ``lens`` [B, 1]
    are (an accelerator's: the upload stays the trees' size): each node's column [B, K]
    and the mask [B, K, total]."""
    n, k, _ = tree_mask.shape
    write_pos = lens + torch.arange(k, device=lens.device)[None]           # [B, K] each node's column
    # the context's columns, then each node's tree row written over the row's K tree columns
    mask = torch.arange(total, device=lens.device).expand(n, k, total) < lens[:, :, None]   # [B, K, T]
    mask.scatter_(2, write_pos[:, None, :].expand(n, k, k), tree_mask)
    return write_pos, mask

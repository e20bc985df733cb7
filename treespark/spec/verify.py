"""Verification of a draft tree against the target's distributions at its nodes.

Terms: node ``i``'s *target distribution* is the target's next-token distribution
after the root-to-i path, read from one tree-attention forward. The *accepted path*
is the deepest chain of nodes that survive; the round then emits the path's tokens
plus one token drawn from the target at the last accepted node (the *bonus* or the
*recovered* token), which becomes the next round's root.

* Greedy (T = 0): walk down while some child holds the target's argmax. The output
  is the target's greedy continuation whatever the tree.
* Sampled (T > 0): recursive rejection sampling (SpecInfer; Jeon et al. 2024,
  "Recursive speculative decoding") with siblings drawn *without replacement*.
  At a node with target distribution p and children x_1..x_K drawn in order from
  q_1 = q, q_{j+1} = q_j without x_j (renormalised): accept x_j with probability
  min(1, p_j(x_j) / q_j(x_j)); on rejection p_{j+1} = norm(max(p_j - q_j, 0)).
  If every child is rejected, emit a draw from the last residual. The emitted
  sequence is distributed exactly as the target's (Leviathan et al. 2023, Thm 1,
  applied recursively).

Calibration records are (q, accepted, sibling rank) for every child of every accepted
node: the edges whose ancestors were accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treespark.spec.sampling import Sampler
from treespark.spec.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    path: tuple[int, ...]      # accepted draft nodes (root excluded), root to leaf
    tokens: tuple[int, ...]    # emitted: the path's tokens, then one target token
    records: tuple[tuple[float, bool, int], ...]  # (q, accepted, sibling rank) of edges below accepted nodes

    @property
    def accepted(self) -> int:
        """Draft tokens accepted this round (the emitted bonus token excluded)."""
        return len(self.path)


def _records(tree: DraftTree, node: int, accepted_child: int | None) -> list[tuple[float, bool, int]]:
    """Children are stored in the order they were added: their sibling rank."""
    return [(tree.q[c], c == accepted_child, r) for r, c in enumerate(tree.children[node])]


def walked(tree: DraftTree, path: Sequence[int], final: int) -> VerifyResult:
    """The result of a walk done elsewhere (the device): the accepted nodes, root to
    leaf, and the token drawn at the last one; the records follow from the tree."""
    records, node = [], 0
    for child in [*path, None]:
        records += _records(tree, node, child)
        if child is not None:
            assert tree.parents[child] == node, "a walk goes from parent to child"
            node = child
    tokens = tuple(tree.tokens[i] for i in path) + (int(final),)
    return VerifyResult(path=tuple(path), tokens=tokens, records=tuple(records))


def verify_greedy(tree: DraftTree, target_argmax: Sequence[int]) -> VerifyResult:
    """target_argmax: [N] the target's argmax token after each node."""
    assert len(target_argmax) == tree.num_nodes
    node, path, records = 0, [], []
    while True:
        best = int(target_argmax[node])
        child = next((c for c in tree.children[node] if tree.tokens[c] == best), None)
        records += _records(tree, node, child)
        if child is None:
            tokens = tuple(tree.tokens[i] for i in path) + (best,)
            return VerifyResult(path=tuple(path), tokens=tokens, records=tuple(records))
        path.append(child)
        node = child


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); p itself where p <= q everywhere (then nothing is rejected)."""
    r = (p - q).clamp(min=0.0)
    s = r.sum()
    return r / s if s > 0 else p


def verify_sampled(tree: DraftTree, target: torch.Tensor, sampler: Sampler) -> VerifyResult:
    """target: [N, V] float64, the target distribution after each node (temperature
    and top-p applied)."""
    assert target.shape[0] == tree.num_nodes
    vocab = target.shape[1]
    node, path, records = 0, [], []
    while True:
        p = target[node]
        accepted_child = None
        if tree.children[node]:
            q = tree.child_probs_full(node, vocab)
            for child in tree.children[node]:
                x = tree.tokens[child]
                qx = float(q[x])
                assert qx > 0, "a drawn sibling must have positive proposal probability"
                if sampler.bernoulli(min(1.0, float(p[x]) / qx)):
                    accepted_child = child
                    break
                p = residual(p, q)
                q = q.clone()
                q[x] = 0.0
                mass = q.sum()
                if mass <= 0:
                    break
                q = q / mass
        records += _records(tree, node, accepted_child)
        if accepted_child is None:
            final = sampler.categorical(p)
            tokens = tuple(tree.tokens[i] for i in path) + (final,)
            return VerifyResult(path=tuple(path), tokens=tokens, records=tuple(records))
        path.append(accepted_child)
        node = accepted_child

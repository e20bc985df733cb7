"""``tree_batch``: the verify forward's inputs for a batch of trees."""

from __future__ import annotations

import numpy as np
import torch

from treespark.spec.tree import DraftTree, tree_batch


def _tree(tokens, parents, depths) -> DraftTree:
    n = len(tokens)
    return DraftTree.from_arrays(np.asarray(tokens), np.asarray(parents), np.asarray(depths), np.ones(n), np.ones(n))


def test_roots_alone_see_their_context_and_themselves():
    lengths = [3, 0, 5]
    b = tree_batch([DraftTree.root_only(t) for t in (7, 8, 9)], lengths, torch.device("cpu"))
    assert b.tokens.tolist() == [[7], [8], [9]]
    assert b.positions.tolist() == b.write_pos.tolist() == [[3], [0], [5]]
    assert b.mask.shape == (3, 1, 1, 6)
    assert b.mask[:, 0, 0].tolist() == [[c <= n for c in range(6)] for n in lengths]


def test_a_batch_of_roots_is_what_a_wider_batch_gives_its_roots():
    # a two-node tree in the batch takes the general path: its rows' root columns and
    # context are what the roots-only batch gives
    lengths = [3, 0, 5]
    roots = tree_batch([DraftTree.root_only(t) for t in (7, 8, 9)], lengths, torch.device("cpu"))
    wide = tree_batch([_tree([7, 4], [-1, 0], [0, 1]), DraftTree.root_only(8), DraftTree.root_only(9)], lengths,
                      torch.device("cpu"))
    assert torch.equal(wide.tokens[:, :1], roots.tokens) and torch.equal(wide.positions[:, :1], roots.positions)
    assert torch.equal(wide.write_pos[:, :1], roots.write_pos)
    assert torch.equal(wide.mask[:, :, :1, :6], roots.mask)
    assert not wide.mask[:, :, :1, 6:].any()

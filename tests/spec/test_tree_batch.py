"""``tree_batch``: the verify forward's inputs for a batch of trees."""

from __future__ import annotations

import numpy as np
import torch

from treespark.spec.tree import DraftTree, context_and_tree_mask, tree_batch, widened_on_device


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


def test_the_host_mask_is_the_devices():
    """On a CPU the whole mask is made on the host; the device's construction (an
    accelerator's: the trees' masks uploaded, widened there) gives the same, on random
    trees of different sizes after different contexts."""
    rng = np.random.default_rng(4)
    k, lengths = 9, np.array([4, 0, 11, 7])
    tree_mask = np.zeros((4, k, k), dtype=bool)
    for b, n in enumerate((1, 5, 9, 3)):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        for i in range(k):
            j = i if i < n else 0          # padding rows see the root
            while j >= 0:
                tree_mask[b, i, j] = True
                j = parents[j]
    host = context_and_tree_mask(tree_mask, lengths)
    write_pos, device = widened_on_device(torch.as_tensor(tree_mask), torch.as_tensor(lengths)[:, None], 11 + k)
    assert torch.equal(torch.as_tensor(host), device)
    assert write_pos.tolist() == [[n + i for i in range(k)] for n in lengths]
    assert host[2, 4, :11].all() and not host[1, :, 5:].any() and host[3, 2, 7 + 2] and host[3, 2, 7]

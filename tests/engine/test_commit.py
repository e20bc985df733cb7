"""The commit stage's arithmetic: which KV slots move and where the drafter's context goes."""

from __future__ import annotations

import numpy as np

from treespark.engine.commit import commit_plan


def test_an_accepted_path_moves_down_next_to_the_context_and_a_chain_in_place_moves_nothing():
    # row 0: length 5, tree path 2 -> 5 (a branch); row 1: length 3, chain 1 -> 2 (in place);
    # row 2: nothing accepted. Slots: row i's position p lives at slot 100 i + p.
    plan = commit_plan([[2, 5], [1, 2], []], [5, 3, 7], lambda i, positions: [100 * i + p for p in positions])
    assert plan.keeps == [[0, 2, 5], [0, 1, 2], [0]]
    assert plan.rows == [0, 0, 0, 1, 1, 1, 2] and plan.nodes == [0, 2, 5, 0, 1, 2, 0]
    # row 0's root and nodes sat at positions 5 + (0, 2, 5); they move to 5, 6, 7
    assert plan.src == [5, 7, 10] and plan.dst == [5, 6, 7]
    assert plan.ctx_pos == [5, 6, 7, 3, 4, 5, 7]
    assert plan.ctx_slots == [5, 6, 7, 103, 104, 105, 207]
    packed = plan.packed()
    assert packed.dtype == np.int64 and packed.tolist() == [*plan.rows, *plan.nodes, *plan.src, *plan.dst,
                                                              *plan.ctx_pos, *plan.ctx_slots]

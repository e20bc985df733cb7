"""``slot_table`` (many opened nodes as arrays, the engine's) against ``slot_values``
(one node, the host reference's)."""

import numpy as np
import pytest

from treespark import Calibration
from treespark.spec.select import slot_table, slot_values


@pytest.mark.parametrize("sampled", [False, True])
def test_the_table_is_slot_values_for_every_node(sampled):
    rng = np.random.default_rng(3)
    cal = Calibration(1.3, -0.2, sibling_bias=(-0.5, -0.9))
    p, m, k, vocab = 40, 6, 4, 50
    q = rng.dirichlet(np.full(vocab, 0.3), size=p)
    top_ids = np.argsort(-q, 1)[:, :m]
    top_q = np.take_along_axis(q, top_ids, 1)
    drawn_ids = np.stack([rng.choice(vocab, k, replace=False, p=row) for row in q])
    drawn_q = np.take_along_axis(q, drawn_ids, 1)
    drawn_q[::7, 2:] = 0.0                    # some nodes run out of support
    drawn_ids[::5, 3] = drawn_ids[::5, 1]     # and some repeat a token (rounding)
    table = slot_table(top_q, top_ids, drawn_ids if sampled else None, drawn_q if sampled else None,
                       cal, k, vocab)
    for i in range(p):
        c = table.count[i]
        drawn = list(zip(drawn_ids[i].tolist(), drawn_q[i].tolist(), strict=True)) if sampled else None
        want = slot_values(top_q[i].tolist(), top_ids[i].tolist(), drawn, cal, k, vocab)
        assert tuple(table.ids[i, :c].tolist()) == want.ids
        for a, b in ((table.q[i, :c], want.q), (table.expected[i, :c], want.expected),
                     (table.realized[i, :c], want.realized)):
            assert np.allclose(a, b, rtol=1e-12, atol=1e-15)

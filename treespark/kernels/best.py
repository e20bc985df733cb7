"""The per-step allocation's argmax in one native call (``best.c``).

``treespark.pricing.allocate.best_allocation`` (numpy, the reference; the control plane
prices with it and imports no torch) makes ~40 array calls on arrays of a few dozen
candidates: ~0.05 ms in a loop, ~0.18 ms a call inside a decoding step, where each one
starts cold, and a step of the served default calls it twice. ``ranked_argmax`` hands
the same candidates, verify row and drafting seconds to ``ts_best``, which ranks and
scans them in the same order and the same arithmetic: the same doubles (the engine's
``treespark.engine.step_alloc.native_best``; ``tests/kernels/test_best.py``).
"""

from __future__ import annotations

import numpy as np

from treespark.kernels.native import library, pointer


def ranked_argmax(scores: np.ndarray, lens: np.ndarray, max_nodes: int, floor: float, verify: np.ndarray,
                  fixed: np.ndarray | None, draft_s: float, node_s: float
                  ) -> tuple[np.ndarray, np.ndarray, int, int, float, float]:
    """``ts_best`` over ``scores`` (float64, contiguous: every row's first ``lens[r]``
    candidates, row after row; ``lens`` int64 [B], each at most ``max_nodes``), keeping
    those >= ``floor``; ``verify`` [max_nodes + 1] float64 the verify seconds by nodes,
    ``fixed`` [max_nodes + 1] float64 the drafting seconds of a plan by its pad (None:
    drafted already). Returns the kept candidates' rows [N] and scores [N] in rank order,
    the argmax's pad and prefix (0, 0: plain decoding is best), its goodput and plain
    decoding's: ``treespark.pricing.allocate.Best``'s fields, in its order."""
    assert scores.dtype == verify.dtype == np.float64 and lens.dtype == np.int64
    n = len(scores)
    rows, s, out = np.empty(n, dtype=np.int64), np.empty(n), np.empty(5)
    rc = library().ts_best(scores.ctypes.data, lens.ctypes.data, len(lens), max_nodes, floor, verify.ctypes.data,
                           pointer(fixed), draft_s, node_s, rows.ctypes.data, s.ctypes.data, out.ctypes.data)
    if rc != 0:
        raise ValueError(f"ts_best refused {len(lens)} rows of up to {max_nodes} candidates")
    k = int(out[0])
    return rows[:k], s[:k], int(out[1]), int(out[2]), float(out[3]), float(out[4])

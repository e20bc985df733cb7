"""A round's greedy draft trees grown in one native call (``waves.c``).

``treespark.spec.drafting.WaveDrafter`` grows a batch's trees a depth wave at a time:
per wave ~100 numpy and torch operators (the forest's ranking, the parents' upload, the
drafter's scoring, the fetch, the slots, the scatter of the children), ~1 ms on a CPU
where the wave's arithmetic is ~0.1 ms. Where every row is at T = 0 and the drafter's
numbers are on the CPU, ``greedy_forest`` runs all the waves in C over the ``Forest``'s
own arrays: the same rule (``treespark.spec.select``), the same trees to float rounding
of the logits (``tests/spec/test_native_waves.py``). Verification is untouched, so the
output stays the target's whatever the draft.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from treespark.kernels.native import library, operator, pointer
from treespark.spec.budget import Budget
from treespark.spec.calibration import _EPS, Calibration
from treespark.spec.forest import Forest
from treespark.spec.select import TOP_M
from treespark.spec.tree import DraftTree

PROFILER_NAME = "treespark::greedy_forest"   # what torch.profiler calls the call (an operator, as native_linear is)


def available(t: torch.Tensor) -> bool:
    """Whether ``greedy_forest`` runs on ``t``'s device: the CPU, with the kernels built."""
    return t.device.type == "cpu" and library() is not None


PANEL = 32   # draft tokens a panel of W2 holds (waves.c's VW)


def panels(w2: torch.Tensor) -> torch.Tensor:
    """W2 [Vd, r] as the float32 panels ``greedy_forest`` reads: [ceil(Vd / PANEL), r,
    PANEL], panel c holding tokens c * PANEL .. at every rank (the last padded with zeros)."""
    vd, r = w2.shape
    n = -(-vd // PANEL)
    padded = torch.zeros(n * PANEL, r, dtype=torch.float32)
    padded[:vd] = w2.detach().float().cpu()
    return padded.view(n, PANEL, r).transpose(1, 2).contiguous()


def greedy_forest(roots: list[int], budgets: list[Budget], depth_limits: list[int], d2t: np.ndarray | None,
                  base: torch.Tensor, w1: torch.Tensor, w2p: torch.Tensor, calibrations: list[Calibration]
                  ) -> tuple[Forest, int, list[DraftTree], list[np.ndarray]]:
    """A round's ``Forest`` (as ``Forest(roots, budgets, depth_limits, d2t)`` would start it)
    grown to the end at T = 0, the waves run, and its trees and their nodes' candidates
    (as ``Forest.finish`` returns them, chosen in the same call). base [R, D, Vd] the
    drafter's base logits; w1 [V, r] float32 (rows by the parent's token id); w2p W2's
    ``panels``; one calibration (the map at T = 0) a row. Grown in one call in room for
    every node a round can open (``Forest.whole_round``)."""
    lib = library()
    assert lib is not None
    base = base.float().contiguous()
    assert base.shape[0] == len(roots) and w1.dtype == torch.float32 and w1.is_contiguous()
    caps = np.array([b.branch_cap for b in budgets], dtype=np.int64)
    forest = Forest(roots, budgets, depth_limits, d2t, room=Forest.whole_round(budgets, depth_limits))
    kept = np.empty(forest.rows, dtype=np.int64)                    # each row's tree: its nodes,
    chosen = np.empty((2, *forest.parent.shape), dtype=np.int64)   # their candidates and parents
    waves = _grow(lib, forest, base, w1, w2p, calibrations, caps, kept, chosen)
    if waves < 0:
        raise RuntimeError(f"ts_greedy_forest failed ({waves}: {_FAILURES.get(waves, 'error')})")
    keeps = [chosen[0, b, :n] for b, n in enumerate(kept.tolist())]
    parents = [chosen[1, b, :len(keep)] for b, keep in enumerate(keeps)]
    return forest, waves, forest.trees(keeps, parents), keeps


_OUTGROWN = -1   # ts_greedy_forest's code for a row that outgrew the forest's arrays
_FAILURES = {_OUTGROWN: "outgrew its room", -2: "out of memory", -3: "a kept node's parent was not kept"}


@functools.lru_cache(maxsize=64)
def _calibration_arrays(calibrations: tuple[Calibration, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' maps as ``ts_greedy_forest`` reads them (read only): sibling offsets [R,
    noff] (rank j takes column min(j, noff - 1)), a [R] and b [R]; made once for the
    batch's maps (a step's rows bring the same ones, step after step)."""
    noff = 1 + max((len(c.sibling_bias) for c in calibrations), default=0)
    off = np.array([[c.offset(j) for j in range(noff)] for c in calibrations], dtype=np.float64)
    made = (off.reshape(len(calibrations), noff), np.array([c.a for c in calibrations], dtype=np.float64),
            np.array([c.b for c in calibrations], dtype=np.float64))
    for x in made:
        x.flags.writeable = False
    return made


def _grow(lib, forest: Forest, base: torch.Tensor, w1: torch.Tensor, w2p: torch.Tensor,
          calibrations: list[Calibration], caps: np.ndarray, kept: np.ndarray, chosen: np.ndarray) -> int:
    """One ``ts_greedy_forest`` call over ``forest``'s arrays (``caps`` [R] int64 the rows'
    branch caps), writing each row's tree (int64: ``kept`` [R] its nodes, ``chosen`` [2, R,
    C] their candidates and parents): the waves run, or a failure code."""
    r_rows = forest.rows
    off, a, b = _calibration_arrays(tuple(calibrations))
    noff = off.shape[1]
    limits = np.where(forest.speculates, forest.depth_limit, 0).astype(np.int64)
    opened = forest.opened.view(np.uint8)
    d2t64 = None if forest.d2t is None else np.ascontiguousarray(forest.d2t, dtype=np.int64)
    args = (pointer(base), base.shape[1], base.shape[2], pointer(w1), w1.shape[1], pointer(w2p), pointer(d2t64), r_rows,
            pointer(forest.theta), pointer(forest.node_cap), pointer(caps), pointer(limits), pointer(a), pointer(b), pointer(off), noff,
            ctypes.c_double(_EPS), TOP_M, pointer(forest.parent), pointer(forest.draft_id), pointer(forest.token),
            pointer(forest.q), pointer(forest.score), pointer(forest.survival), pointer(forest.depth), pointer(opened),
            pointer(forest.size), forest.parent.shape[1], pointer(kept), pointer(chosen[0]), pointer(chosen[1]),
            torch.get_num_threads())
    with operator(PROFILER_NAME):
        return lib.ts_greedy_forest(*args)

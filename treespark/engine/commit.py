"""Where a step's accepted tokens go (the commit stage's host arithmetic, step 4 of
``treespark.engine.core``).

Each row keeps its tree's root and accepted path. Their target keys and values were
written at the tree's slots (position = length + node index); the path moves down next
to the committed context (position = length + its index on the path), inside the
request's own tail blocks. Every kept node's tapped hidden state goes to the drafter's
context at its new position. ``commit_plan`` turns the paths into the slots of those
moves and writes, as flat lists ready for one upload; ``apply_commit`` carries them out
on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treespark.engine.kv import PagedKV
from treespark.engine.prefill import write_context
from treespark.kernels.transfer import HostTransfers
from treespark.models.drafter import DSparkDrafter


@dataclass(frozen=True)
class CommitPlan:
    keeps: list[list[int]]  # each row's kept tree nodes: 0 (the root), then its accepted path
    rows: list[int]         # per kept node (rows in order): its batch row
    nodes: list[int]        # per kept node: its tree node (the taps' index in the forward)
    src: list[int]          # target KV slots moved, from (tree slots) ...
    dst: list[int]          # ... to (the positions after the committed context)
    ctx_pos: list[int]      # per kept node: its position in the sequence
    ctx_slots: list[int]    # per kept node: its slot there (the drafter's context is written at it)

    def packed(self) -> np.ndarray:
        """Every list in one int64 array (one upload): rows, nodes, src, dst, ctx_pos, ctx_slots."""
        return np.asarray([*self.rows, *self.nodes, *self.src, *self.dst, *self.ctx_pos, *self.ctx_slots],
                          dtype=np.int64)


def commit_plan(paths: list[list[int]], lengths: list[int], slots: Callable[[int, list[int]], list[int]]) -> CommitPlan:
    """``paths[i]``: row i's accepted tree nodes (root excluded), root to leaf;
    ``lengths[i]``: its committed length before the step; ``slots(i, positions)``: the
    KV slots of row i's positions. A row whose path is already in place (0, 1, 2, ...:
    a chain accepted from its start) moves nothing."""
    keeps = [[0, *p] for p in paths]
    rows = [i for i, keep in enumerate(keeps) for _ in keep]
    nodes = [x for keep in keeps for x in keep]
    kept = [list(range(lengths[i], lengths[i] + len(keep))) for i, keep in enumerate(keeps)]
    src: list[int] = []
    dst: list[int] = []
    ctx_slots: list[int] = []
    for i, (keep, pos) in enumerate(zip(keeps, kept, strict=True)):
        at = slots(i, pos)
        if keep != list(range(len(keep))):
            src += slots(i, [pos[0] + x for x in keep])
            dst += at
        ctx_slots += at
    return CommitPlan(keeps, rows, nodes, src, dst, [p for pos in kept for p in pos], ctx_slots)


def apply_commit(plan: CommitPlan, kv: PagedKV, drafter: DSparkDrafter, taps: torch.Tensor,
                 transfers: HostTransfers) -> torch.Tensor:
    """Carry ``plan`` out in one upload and a few batched device operations: one gather of
    the kept nodes' taps (``taps`` [B, K, taps]), one move in the target's store (the
    drafter's context is written anew from the taps), one drafter call and write. Returns
    the kept taps [M, taps], rows in order."""
    m, e = len(plan.rows), len(plan.src)
    ints = transfers.upload(plan.packed(), torch.long)
    kept_taps = taps[ints[:m], ints[m:2 * m]]                                         # [M, taps]
    if e:
        kv.target.move(ints[2 * m:2 * m + e], ints[2 * m + e:2 * m + 2 * e])
    at = 2 * m + 2 * e
    write_context(drafter, kv.drafter, ints[at:at + m], ints[at + m:at + 2 * m], kept_taps)
    return kept_taps

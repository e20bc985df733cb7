"""Argmax and a small top-k over the vocabulary axis, without torch's walk over every index.

torch's CPU ``argmax`` and ``topk`` walk every element of a row with its index; over
a vocabulary-wide row that is 1.5-2 ns an element, where a plain maximum streams at
memory speed. So on the CPU:

* ``argmax``: one native call over every row (``vocab.c``: a vector pass for the row's
  maximum, then a scan for its first occurrence), the first maximal index, which is
  what ``torch.argmax`` returns (a NaN counting as the maximum, as there); without the
  library, two torch passes over blocks of ``BLOCK`` logits: each block's maximum
  (``amax``), then the first block holding the row's, and the first maximum inside it;
* ``topk``: the ``m`` blocks with the largest maxima hold the row's ``m`` largest
  values (a block outside them has ``m`` blocks above it, each with a value at least
  its maximum), so top-``m`` of those ``m * BLOCK`` candidates is the row's top-``m``:
  the same values, in descending order, and the same indices except between equal values
  (whose order ``torch.topk`` does not promise either).

One thread, float32 (``bench`` in the tests' module docstring): argmax over [8, 16,
151,936] 30 ms -> 4.6 ms (blocks), over [1, 8, 49,152] 0.66 -> 0.09 ms; top-16 of
[16, 151,936] 5.6 -> 0.8 ms. The native argmax is one operator where the blocks are
eight. A row too short to gain (or, for the blocks, not a whole number of them) and
every other device (whose kernels are already parallel over the row) take torch's own.
"""

from __future__ import annotations

import torch

from treespark.kernels.native import library, operator

BLOCK = 128


def _blocked(x: torch.Tensor, m: int) -> bool:
    """Whether the blocked passes take ``x``'s last axis (picking ``m`` per row)."""
    v = x.shape[-1]
    return x.device.type == "cpu" and x.dim() >= 1 and v % BLOCK == 0 and v >= 8 * m * BLOCK


PROFILER_NAME = "treespark::argmax_rows"   # what torch.profiler calls the native argmax


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: [...] int64, the first maximal index of each row."""
    if not _blocked(x, 1) or x.numel() == 0:
        return x.argmax(-1)
    lib = library()
    if lib is not None and x.dtype == torch.float32 and x.is_contiguous():
        out = torch.empty(x.shape[:-1], dtype=torch.int64)
        with operator(PROFILER_NAME):
            lib.ts_argmax_rows(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], out.data_ptr(),
                               torch.get_num_threads())
        return out
    lead, v = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(-1, v // BLOCK, BLOCK)                      # a view where x is contiguous
    best = blocks.amax(-1).argmax(-1)                              # [N] the first block holding the maximum
    inside = blocks[torch.arange(blocks.shape[0], device=x.device), best].argmax(-1)   # [N]
    return (best * BLOCK + inside).view(lead)


def topk(x: torch.Tensor, m: int) -> torch.return_types.topk:
    """``x.topk(m, dim=-1)`` of a 2-D ``x`` [P, V]: values [P, m] descending and their indices."""
    if not _blocked(x, m) or x.dim() != 2 or x.shape[0] == 0:
        return x.topk(m, dim=-1)
    p, v = x.shape
    blocks = x.reshape(p, v // BLOCK, BLOCK)
    chosen = blocks.amax(-1).topk(m, dim=-1).indices                                # [P, m] block ids
    cand = blocks.gather(1, chosen[..., None].expand(p, m, BLOCK)).view(p, m * BLOCK)
    top = cand.topk(m, dim=-1)
    idx = chosen.gather(1, top.indices // BLOCK) * BLOCK + top.indices % BLOCK
    return torch.return_types.topk((top.values, idx))

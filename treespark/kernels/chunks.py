"""Causal attention of a prefill's packed prompt chunks over a paged store, read in place
(``chunks.c``): one native call a layer for every chunk of the step, where the torch path
gathers each chunk's blocks into a copy, builds its additive mask and calls SDPA's flash
kernel per chunk. The lanes are queries, not the head dimension, so any head size
vectorises; keys past a query's position are never computed; a query's values do not
depend on the chunking, the batch or the threads (``tests/kernels/test_chunks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespark.kernels.native import library, operator

PROFILER_NAME = "treespark::chunk_attention"
# the largest head it is given (chunks.c takes up to 256): its vector form broadcasts a key's
# float per FMA where SDPA's flash kernel blocks them as matrix products, so at long contexts
# and heads of 128 SDPA is faster. Against the torch path (gather, flash under the bias made
# once a forward), one layer, one thread, AVX-512 Xeon (`treespark bench attention`): heads
# of 16 (the tiny pairs) 0.40-0.56 of its time, 64 (the default pair) 0.57-0.83, 128 (Qwen3)
# 0.80 at no context but 1.29-1.39 over 1,024-1,244 keys. On AMX, heads of a multiple of 64
# take the tile form instead (~0.65-0.7 of the vector form's time at 64, 1,244-1,500 keys)
MAX_HEAD = 64


def can_attend(dtype: torch.dtype, cache: torch.Tensor) -> bool:
    """Whether ``chunk_attention`` takes queries of ``dtype`` over this cache [slots, kvh,
    hd]: float32 on the CPU, a head of at most ``MAX_HEAD``, the library built with a
    vector form (AVX2 or AVX-512)."""
    lib = library()
    return (cache.device.type == "cpu" and dtype == cache.dtype == torch.float32 and cache.shape[-1] <= MAX_HEAD
            and lib is not None and lib.ts_chunk_lanes() > 0)


@dataclass(frozen=True)
class PackedChunks:
    """A prefill's chunks as ``chunk_attention`` reads them: ``tables`` [C, nb] each chunk's
    blocks, ``spans`` [C, 3] each chunk's (offset in the packed row, size, first position),
    int64 on the CPU (as the engine uploads them)."""

    tables: torch.Tensor
    spans: torch.Tensor
    block_size: int

    def __post_init__(self) -> None:
        for name in ("tables", "spans"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 2 or not t.is_contiguous():
                raise ValueError(f"PackedChunks.{name} must be a contiguous 2-d int64 tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if self.spans.shape != (self.tables.shape[0], 3):
            raise ValueError(f"PackedChunks needs a (offset, size, start) span per table row, got spans "
                             f"{tuple(self.spans.shape)} for {self.tables.shape[0]} tables")


def chunk_attention(q: torch.Tensor,      # [1, H, N, hd] the packed row's queries
                    kc: torch.Tensor,     # [slots, kvh, hd] one layer's keys of a paged store
                    vc: torch.Tensor,     # [slots, kvh, hd] and values
                    chunks: PackedChunks,
                    scale: float) -> torch.Tensor:
    """Each chunk's queries over its own keys up to their positions: [1, H, N, hd]."""
    _, h, n, hd = q.shape
    kvh, nb = kc.shape[1], chunks.tables.shape[1]
    assert kc.is_contiguous() and vc.is_contiguous()
    q = q.contiguous()
    out = torch.empty(1, h, n, hd, dtype=torch.float32)
    with operator(PROFILER_NAME):
        rc = library().ts_chunk_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), chunks.tables.data_ptr(), nb,
                                          chunks.block_size, chunks.spans.data_ptr(), chunks.spans.shape[0], scale,
                                          out.data_ptr(), h, kvh, n, hd, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_chunk_attention refused queries {tuple(q.shape)} over {kvh} KV heads, {nb} blocks, "
                         f"spans {chunks.spans.tolist()}")
    return out

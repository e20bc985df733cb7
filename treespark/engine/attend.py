"""Attention over the engine's KV stores: one forward's attention prepared once, then
run per layer (the target), and the drafter's cached context read from the blocks.

A target forward knows its attention only as a ``LayerAttention``: each layer writes its
new keys and values through it, then attends through it. Two kinds:

* ``StoreAttention``: a batch of rows padded to one width, each row its own context
  (the verify forward over draft trees; the dense forwards that measure and train);
* ``ChunkAttention``: a prefill's prompt chunks packed into one row with no padding,
  each chunk attending only its own request's blocks up to its own last position;
* ``MixedAttention``: both in one forward (a decode step's trees, then the step's
  prefill chunks, as one row), each part writing and attending as it would alone.

The maths and the kernels each path reaches are ``treespark.kernels.attention``. Here
is only what knows the stores: which keys a forward reads (the dense store's rows, or
the paged store's blocks through the batch's block table) and the mask turned once
per forward into what the chosen path takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

from treespark.engine.kv import KVStore, PagedKV, PagedRows, PagedStore, blocks_for
from treespark.kernels import blocks
from treespark.kernels.attention import (
    AttentionPath,
    PagedView,
    attention_bias,
    gather_blocks,
    grouped_attention,
    reference_attention,
)
from treespark.kernels.chunks import PackedChunks
from treespark.kernels.chunks import can_attend as can_attend_chunks
from treespark.kernels.chunks import chunk_attention as native_chunks


def table_columns(table: torch.Tensor, nb: int) -> torch.Tensor:
    """[B, nb]: ``table`` cut or padded with the null block (0) to ``nb`` columns."""
    have = table.shape[1]
    return table[:, :nb] if have >= nb else F.pad(table, (0, nb - have))


class LayerAttention(Protocol):
    """One forward's attention, layer by layer: ``write`` the layer's new keys and values,
    then attend with its queries."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, kvh, K, hd], the forward's tokens' keys and values."""
        ...

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [B, H, K, hd] -> [B, H, K, hd]."""
        ...


def _attend(path: AttentionPath, store: KVStore | PagedStore, rows: slice | PagedRows | None, layer: int,
            q: torch.Tensor, mask: torch.Tensor, bias: Callable[[], torch.Tensor | None], table: torch.Tensor | None,
            scale: float, block_size: int) -> torch.Tensor:
    """q [B, H, K, hd] over the keys of ``rows`` (the reference: read slot by slot, the
    boolean mask; grouped: the blocks of ``table`` when paged, in place under the mask
    where the native attention takes them, else SDPA with ``bias()``, the additive bias)."""
    if path is AttentionPath.REFERENCE:
        assert rows is not None
        keys, values = store.read(layer, rows, mask.shape[-1])
        return reference_attention(q, keys, values, mask, scale)
    if table is not None:
        assert isinstance(store, PagedStore)
        if blocks.can_attend(q, store.k[layer]):
            return blocks.paged_attention(q, store.k[layer], store.v[layer], table, block_size, mask, scale)
        keys = gather_blocks(store.k[layer], table, block_size)
        values = gather_blocks(store.v[layer], table, block_size)
    else:
        assert rows is not None
        keys, values = store.read(layer, rows, mask.shape[-1])
    additive = bias()
    assert additive is not None
    return grouped_attention(q, keys.to(q.dtype), values.to(q.dtype), additive, scale)


def _prepared(path: AttentionPath, rows: PagedRows, mask: torch.Tensor, groups: int,
              dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(bias, table) of a chunk's grouped path, built once for every layer: its keys a
    whole number of blocks; (None, None) on the reference path."""
    if path is not AttentionPath.GROUPED:
        return None, None
    nb = blocks_for(mask.shape[-1], rows.block_size)
    return attention_bias(mask, groups, dtype, nb * rows.block_size), table_columns(rows.table, nb)


@dataclass(frozen=True)
class StoreAttention:
    """One forward's attention over a store, rows padded to one width: each row writes its
    tokens (at ``slots`` of a paged store, looked up once for every layer, or at
    ``write_pos`` of its dense row) and attends its own context under ``mask``."""

    path: AttentionPath
    store: KVStore | PagedStore
    rows: slice | PagedRows | None  # None: the grouped path over ``table`` alone (``table_attention``)
    slots: torch.Tensor | None      # [B, K] a paged store's slot of each token
    write_pos: torch.Tensor | None  # [B, K] a dense store's position of each token in its row
    mask: torch.Tensor              # [B, 1, K, T] bool, True = may attend
    table: torch.Tensor | None      # [B, T' / block size] the blocks it reads (the grouped path's, paged)
    scale: float
    groups: int                     # query heads a KV head
    dtype: torch.dtype              # the queries'
    block_size: int = 0             # the paged store's (with ``table``)

    @cached_property
    def bias(self) -> torch.Tensor | None:
        """The grouped path's additive bias [B, 1, G*K, T'] (T' >= T: whole blocks over a
        table), made the first time SDPA needs it and kept for every layer; None on the
        reference path. The native attention reads ``mask`` itself and never makes it."""
        if self.path is not AttentionPath.GROUPED:
            return None
        keys = self.mask.shape[-1] if self.table is None else self.table.shape[1] * self.block_size
        return attention_bias(self.mask, self.groups, self.dtype, keys)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.slots is not None:
            assert isinstance(self.store, PagedStore)
            self.store.write_at(layer, self.slots, k, v)
        else:
            assert isinstance(self.store, KVStore) and isinstance(self.rows, slice) and self.write_pos is not None
            self.store.write(layer, self.rows, self.write_pos, k, v)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return _attend(self.path, self.store, self.rows, layer, q, self.mask, lambda: self.bias, self.table,
                       self.scale, self.block_size)


def store_attention(path: AttentionPath, store: KVStore | PagedStore, rows: slice | PagedRows,
                    write_pos: torch.Tensor, mask: torch.Tensor, *, groups: int, dtype: torch.dtype,
                    scale: float) -> StoreAttention:
    """Prepare a padded batch's attention (the grouped path's block columns, and a paged
    store's write slots, once for every layer; the bias when first needed)."""
    if isinstance(rows, PagedRows):
        slots = rows.slots_at(write_pos)                                    # [B, K]
        if path is AttentionPath.GROUPED:
            table = table_columns(rows.table, blocks_for(mask.shape[-1], rows.block_size))
            return table_attention(store, table, rows.block_size, mask, slots, groups=groups, dtype=dtype,
                                   scale=scale)
        return StoreAttention(path, store, rows, slots, None, mask, None, scale, groups, dtype, rows.block_size)
    return StoreAttention(path, store, rows, None, write_pos, mask, None, scale, groups, dtype)


def table_attention(store: PagedStore, table: torch.Tensor, block_size: int, mask: torch.Tensor,
                    slots: torch.Tensor, *, groups: int, dtype: torch.dtype, scale: float) -> StoreAttention:
    """The grouped path over the blocks of ``table`` [B, nb] (``mask`` [B, 1, K, T], T <=
    nb * block_size), writing at ``slots`` [B, K] (its bias over whole blocks, when SDPA
    first needs it). What ``store_attention`` prepares for a paged store, from tensors
    only: the static-shape forward's (``treespark.engine.graphs``)."""
    return StoreAttention(AttentionPath.GROUPED, store, None, slots, None, mask, table, scale, groups, dtype,
                          block_size)


@dataclass(frozen=True)
class Chunk:
    """One request's prompt chunk in a packed prefill: its tokens at ``offset ..
    offset + size - 1`` of the packed row."""

    offset: int
    size: int
    rows: PagedRows           # [1, start + size] its slots, and its blocks up to its last position
    mask: torch.Tensor        # [1, 1, size, start + size] bool: causal
    bias: torch.Tensor | None  # the grouped path's
    table: torch.Tensor | None


@dataclass(frozen=True)
class ChunkAttention:
    """A prefill's attention over packed chunks: the step's chunks are one row ``[1, N]``
    (no padding), each token written at its slot, each chunk attending its own request's
    keys only, up to its own last position. Attention work is the sum over chunks of
    size x context, where a padded batch pays rows x widest chunk x longest context.
    With ``packed`` (the grouped path over a CPU float32 store) every chunk is attended in
    one native call a layer, its blocks read in place (``treespark.kernels.chunks``), and
    no chunk's mask is built; else chunk by chunk through ``chunks``."""

    path: AttentionPath
    store: PagedStore
    slots: torch.Tensor       # [N] where each packed token's keys and values go
    chunks: tuple[Chunk, ...]
    scale: float
    packed: PackedChunks | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, kvh, N, hd]."""
        self.store.write_at(layer, self.slots[None], k, v)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [1, H, N, hd] -> [1, H, N, hd]."""
        if self.packed is not None:
            return native_chunks(q, self.store.k[layer], self.store.v[layer], self.packed, self.scale)
        outs = [_attend(self.path, self.store, c.rows, layer, q[:, :, c.offset:c.offset + c.size], c.mask,
                        lambda c=c: c.bias, c.table, self.scale, c.rows.block_size) for c in self.chunks]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


@dataclass(frozen=True)
class MixedAttention:
    """A verify forward's trees and a prefill's chunks in ONE forward: its tokens are one
    row ``[1, B K + N]``, the B trees' K (padded) tokens each first, row after row, then
    the N packed chunk tokens. Each layer's keys, values and queries are split there; the
    trees write and attend through ``trees`` ([B, ., K, .]), the chunks through ``chunks``
    ([1, ., N, .]), and their outputs go back into the one row. The weights stream once
    for both, where two forwards stream them twice."""

    trees: StoreAttention
    chunks: ChunkAttention
    rows: int    # B
    width: int   # K

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, h, B K + N, d] -> the trees' [B, h, K, d] and the chunks' [1, h, N, d] (views)."""
        n = self.rows * self.width
        return x[0, :, :n].unflatten(1, (self.rows, self.width)).transpose(0, 1), x[:, :, n:]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        (kt, kc), (vt, vc) = self._split(k), self._split(v)
        self.trees.write(layer, kt, vt)
        self.chunks.write(layer, kc, vc)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        qt, qc = self._split(q)
        trees = self.trees(layer, qt)                                        # [B, H, K, hd]
        return torch.cat([trees.transpose(0, 1).flatten(1, 2)[None], self.chunks(layer, qc)], dim=2)


@dataclass(frozen=True)
class Stacked:
    """A forward's attention as ``blocks.layers`` takes it, for the whole layer stack in
    one native call: the float32 paged ``store`` on the CPU, the trees' ``slots`` [B, K],
    ``table``, ``mask`` and ``scale`` (``slots`` None: no trees) and the packed chunks
    (None: none)."""

    store: PagedStore
    slots: torch.Tensor | None
    table: torch.Tensor | None
    block_size: int
    mask: torch.Tensor | None
    scale: float
    chunks: blocks.PackedRows | None


def _native_store(store: KVStore | PagedStore) -> bool:
    return isinstance(store, PagedStore) and store.k.dtype == torch.float32 and store.k.device.type == "cpu"


def prefill_rows(attend: LayerAttention) -> int:
    """How many of a forward's tokens are a packed prefill's (``ChunkAttention``'s, alone or
    in a ``MixedAttention``): the rows the native blocks do not count against their limit."""
    if isinstance(attend, MixedAttention):
        return prefill_rows(attend.chunks)
    return attend.slots.shape[0] if isinstance(attend, ChunkAttention) else 0


def stacked(attend: LayerAttention) -> Stacked | None:
    """``attend`` as one native call over the layer stack takes it (``Stacked``): a padded
    batch's grouped attention over a block table (a decoding step's trees), a packed
    prefill attended natively (``ChunkAttention.packed``), or both in one forward; None
    for any other (the per-layer path runs it)."""
    if isinstance(attend, MixedAttention):
        trees, chunks = stacked(attend.trees), stacked(attend.chunks)
        if trees is None or chunks is None or trees.store is not chunks.store:
            return None
        return Stacked(trees.store, trees.slots, trees.table, trees.block_size, trees.mask, trees.scale, chunks.chunks)
    if isinstance(attend, ChunkAttention):
        if attend.packed is None or not _native_store(attend.store):
            return None
        return Stacked(attend.store, None, None, attend.packed.block_size, None, attend.scale,
                       blocks.PackedRows(attend.slots, attend.packed, attend.scale))
    if not (isinstance(attend, StoreAttention) and attend.table is not None and attend.slots is not None
            and attend.path is AttentionPath.GROUPED and attend.dtype == torch.float32
            and _native_store(attend.store)):
        return None
    assert isinstance(attend.store, PagedStore)
    return Stacked(attend.store, attend.slots, attend.table, attend.block_size, attend.mask, attend.scale, None)


def chunk_attention(path: AttentionPath, kv: PagedKV, slots: torch.Tensor, positions: torch.Tensor,
                    tables: torch.Tensor, spans: list[tuple[int, int, int]], span_table: torch.Tensor, *,
                    groups: int, dtype: torch.dtype, scale: float, native: bool = True) -> ChunkAttention:
    """Prepare a packed prefill's attention: ``slots`` and ``positions`` [N] of the packed
    tokens, ``tables`` [R, nb] each chunk's block table, ``spans`` each chunk's (offset,
    size, start), on the host and as ``span_table`` [R, 3] on the device; masks, biases
    and block columns built once for every layer (none where one native call a layer
    attends them all: ``ChunkAttention.packed``, on the grouped path where it can and
    ``native`` lets it; False: chunk by chunk, as an accelerator runs them)."""
    if native and path is AttentionPath.GROUPED and can_attend_chunks(dtype, kv.target.k):
        return ChunkAttention(path, kv.target, slots, (), scale, PackedChunks(tables, span_table, kv.block_size))
    chunks = []
    for i, (offset, size, start) in enumerate(spans):
        t = start + size
        rows = kv.rows(tables[i:i + 1, :blocks_for(t, kv.block_size)], t)
        pos = positions[offset:offset + size]
        mask = (torch.arange(t, device=pos.device)[None, :] <= pos[:, None])[None, None]   # [1, 1, S, T]
        bias, table = _prepared(path, rows, mask, groups, dtype)
        chunks.append(Chunk(offset, size, rows, mask, bias, table))
    return ChunkAttention(path, kv.target, slots, tuple(chunks), scale)


@dataclass(frozen=True)
class PagedContext:
    """The drafter's cached context over its paged store (a ``ContextKV``): each layer read
    as whole blocks of the batch's block table, up to the longest row's context plus
    what the caller asks room for; with ``tokens`` None, every column of the table (the
    graphed block pass's static table, as wide as its bucket)."""

    store: PagedStore
    table: torch.Tensor   # [B, nb] block ids
    block_size: int
    tokens: int | None    # the longest row's context; None: the table holds it and the room

    def _columns(self, extra: int) -> torch.Tensor:
        """The table's columns up to the longest row's context + ``extra`` (every column
        with ``tokens`` None)."""
        return self.table if self.tokens is None else \
            table_columns(self.table, blocks_for(self.tokens + extra, self.block_size))

    def read(self, layer: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._columns(extra)
        return (gather_blocks(self.store.k[layer], table, self.block_size),
                gather_blocks(self.store.v[layer], table, self.block_size))

    def paged(self, extra: int) -> PagedView:
        """The store and ``_columns(extra)`` (the engine reserves a drafting row's blocks
        for its drafter block as well)."""
        return PagedView(self.store.k, self.store.v, self._columns(extra), self.block_size)

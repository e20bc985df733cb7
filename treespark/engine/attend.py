"""Attention over the engine's KV stores: one forward's attention prepared once, then
run per layer (the target), and the drafter's cached context read from the blocks.

The maths and the kernels each path reaches are ``treespark.kernels.attention``. Here
is only what knows the stores: which keys a forward reads (the dense store's rows, or
the paged store's blocks through the batch's block table) and the mask turned once
per forward into what the chosen path takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treespark.engine.kv import KVStore, PagedRows, PagedStore, blocks_for
from treespark.kernels.attention import (
    AttentionPath,
    attention_bias,
    gather_blocks,
    grouped_attention,
    reference_attention,
)


def table_columns(table: torch.Tensor, nb: int) -> torch.Tensor:
    """[B, nb]: ``table`` cut or padded with the null block (0) to ``nb`` columns."""
    have = table.shape[1]
    return table[:, :nb] if have >= nb else F.pad(table, (0, nb - have))


@dataclass(frozen=True)
class StoreAttention:
    """One forward's attention over a store: ``__call__(layer, q)`` per layer, after the
    layer's new keys and values are written."""

    path: AttentionPath
    store: KVStore | PagedStore
    rows: slice | PagedRows | None  # None: the grouped path over ``table`` alone (``table_attention``)
    mask: torch.Tensor          # [B, 1, K, T] bool (the reference path's)
    bias: torch.Tensor | None   # [B, 1, G*K, T'] additive, T' >= T (the grouped path's)
    table: torch.Tensor | None  # [B, T' / block size] the blocks it reads (the grouped path's, paged)
    scale: float
    block_size: int = 0         # the paged store's (with ``table``)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [B, H, K, hd] -> [B, H, K, hd]."""
        t = self.mask.shape[-1]
        if self.path is AttentionPath.REFERENCE:
            keys, values = self.store.read(layer, self.rows, t)
            return reference_attention(q, keys, values, self.mask, self.scale)
        assert self.bias is not None
        if self.table is not None:
            keys = gather_blocks(self.store.k[layer], self.table, self.block_size)
            values = gather_blocks(self.store.v[layer], self.table, self.block_size)
        else:
            keys, values = self.store.read(layer, self.rows, t)
        return grouped_attention(q, keys.to(q.dtype), values.to(q.dtype), self.bias, self.scale)


def store_attention(path: AttentionPath, store: KVStore | PagedStore, rows: slice | PagedRows,
                    mask: torch.Tensor, *, groups: int, dtype: torch.dtype, scale: float) -> StoreAttention:
    """Prepare a forward's attention: on the grouped path the bias (and, paged, the block
    table's columns it reads) is built here, once for every layer, its keys a whole number
    of blocks (paged) or the mask's (dense)."""
    if path is AttentionPath.GROUPED and isinstance(rows, PagedRows):
        table = table_columns(rows.table, blocks_for(mask.shape[-1], rows.block_size))
        return table_attention(store, table, rows.block_size, mask, groups=groups, dtype=dtype, scale=scale)
    bias = attention_bias(mask, groups, dtype, mask.shape[-1]) if path is AttentionPath.GROUPED else None
    return StoreAttention(path, store, rows, mask, bias, None, scale)


def table_attention(store: PagedStore, table: torch.Tensor, block_size: int, mask: torch.Tensor, *,
                    groups: int, dtype: torch.dtype, scale: float) -> StoreAttention:
    """The grouped path over the blocks of ``table`` [B, nb] (``mask`` [B, 1, K, T], T <=
    nb * block_size): the bias over whole blocks, built once for every layer. What
    ``store_attention`` prepares for a paged store, from tensors only: the static-shape
    forward's (``treespark.engine.graphs``)."""
    bias = attention_bias(mask, groups, dtype, table.shape[1] * block_size)
    return StoreAttention(AttentionPath.GROUPED, store, None, mask, bias, table, scale, block_size)


@dataclass(frozen=True)
class PagedContext:
    """The drafter's cached context over its paged store (a ``ContextKV``): each layer read
    as whole blocks of the batch's block table, up to the longest row's context plus
    what the caller asks room for."""

    store: PagedStore
    table: torch.Tensor   # [B, nb] block ids
    block_size: int
    tokens: int           # the longest row's context

    def read(self, layer: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = table_columns(self.table, blocks_for(self.tokens + extra, self.block_size))
        return (gather_blocks(self.store.k[layer], table, self.block_size),
                gather_blocks(self.store.v[layer], table, self.block_size))

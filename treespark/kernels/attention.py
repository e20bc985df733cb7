"""Attention over cached keys and values: the one home of its maths.

Two paths compute the same attention of a batch's new queries over its cached keys and
values (the target's verify and prefill forwards, the drafter's block):

* **reference** (``reference_attention``): keys and values ``[B, kvh, T, hd]`` and a
  boolean mask ``[B, 1, K, T]`` straight into ``F.scaled_dot_product_attention`` with
  ``enable_gqa=True``. On CUDA a boolean mask with ``enable_gqa`` takes the *math*
  kernel: queries and keys upcast to float32, K/V repeated from kvh to H heads, the
  ``[B, H, K, T]`` scores materialised. On CPU it takes the flash kernel, after turning
  the boolean mask into an additive one (a ``[B, 1, K, T]`` float tensor) in every call.
* **grouped** (``grouped_attention``): each grouped-query group's G query heads are
  folded into the query axis (``q [B, H, K, hd] -> [B, kvh, G*K, hd]``), so that keys
  and values are never repeated and the call is plain multi-head attention; the mask is
  an additive bias in the queries' dtype, ``[B, 1, G*K, T]``, built once per forward
  (``attention_bias``) and shared by every layer, its key axis a multiple of the
  block size (16 by default: the alignment CUDA's memory-efficient kernel wants). On
  CUDA this takes the memory-efficient kernel (arbitrary bias, bf16 in, no score
  matrix in memory); on CPU the flash kernel, with no mask conversion per layer.

What neither path avoids is the copy of the batch's paged keys and values into a
dense ``[B, kvh, T, hd]`` per layer: a kernel that reads the blocks in place
(FlexAttention with a block mask, a paged-attention kernel) would. In a one-off trial
on this project's CPU (batch 8 x 4k tokens, 16 queries a row, 2 threads), compiled
FlexAttention over one store of every row's slots, with a block mask by row (the
sparsity a block table gives), took ~106 ms a layer against ~31 ms for the slot gather
and the flash kernel, after ~20 s of compiling; so both paths gather. The grouped path
gathers whole blocks (``gather_blocks``: one contiguous row of ``block_size * kvh *
hd`` numbers per block), not slot by slot.

``ContextKV`` is how the drafter reads its cached context: one layer at a time, as a
copy it owns, with room after the longest row's context for the block it drafts, so
the block's own keys and values are written into that copy instead of concatenated
onto it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionPath(enum.Enum):
    """Which attention a forward runs (``reference_attention`` or ``grouped_attention``)."""

    REFERENCE = "reference"
    GROUPED = "grouped"


def reference_attention(q: torch.Tensor,      # [B, H, K, hd]
                        k: torch.Tensor,      # [B, kvh, T, hd]
                        v: torch.Tensor,      # [B, kvh, T, hd]
                        mask: torch.Tensor,   # [B, 1, K, T] bool, True = may attend
                        scale: float | None = None) -> torch.Tensor:
    """The plain SDPA call with grouped-query attention left to the kernel: [B, H, K, hd]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attention_bias(mask: torch.Tensor,   # [B, 1, K, T] bool, True = may attend
                   groups: int, dtype: torch.dtype, keys: int) -> torch.Tensor:
    """The additive bias of ``grouped_attention``: [B, 1, G*K, keys] in ``dtype``, 0 where
    the mask allows, -inf elsewhere and in the columns past T (``keys >= T``)."""
    b, _, k, t = mask.shape
    assert keys >= t, f"the bias needs at least the mask's {t} key columns, got {keys}"
    allowed = F.pad(mask, (0, keys - t), value=False) if keys > t else mask             # [B, 1, K, keys]
    bias = torch.where(allowed, 0.0, float("-inf")).to(dtype)
    # the G copies are the one write of the full size (no fill first, then the mask over it),
    # made even where the reshape could stay a view (one token a row): every layer reads it
    return bias[:, :, None].expand(b, 1, groups, k, keys).reshape(b, 1, groups * k, keys).contiguous()


def grouped_attention(q: torch.Tensor,      # [B, H, K, hd]
                      k: torch.Tensor,      # [B, kvh, T, hd]
                      v: torch.Tensor,      # [B, kvh, T, hd]
                      bias: torch.Tensor,   # [B, 1, G*K, T] from attention_bias
                      scale: float | None = None) -> torch.Tensor:
    """Attention with each group's query heads folded into the query axis: [B, H, K, hd]."""
    b, h, n, hd = q.shape
    kvh = k.shape[1]
    folded = q.reshape(b, kvh, (h // kvh) * n, hd)                     # [B, kvh, G*K, hd]
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=bias, scale=scale)
    return out.view(b, h, n, hd)


def block_slots(table: torch.Tensor,      # [B, nb] block ids
                positions: torch.Tensor,  # [B, S] positions, each within its row's blocks
                block_size: int) -> torch.Tensor:
    """The store slot of each row's positions through its block table: [B, S]."""
    return torch.gather(table, 1, positions // block_size) * block_size + positions % block_size


def gather_blocks(cache: torch.Tensor,    # [slots, kvh, hd] one layer of a paged store
                  table: torch.Tensor,    # [B, nb] block ids
                  block_size: int) -> torch.Tensor:
    """The blocks of ``table`` as dense rows: [B, kvh, nb * block_size, hd] (a copy; the
    keys axis strided, heads outermost, as SDPA takes it)."""
    b, nb = table.shape
    _, kvh, hd = cache.shape
    blocks = cache.view(-1, block_size * kvh * hd).index_select(0, table.flatten())  # [B*nb, bs*kvh*hd]
    return blocks.view(b, nb * block_size, kvh, hd).transpose(1, 2)


@dataclass(frozen=True)
class PagedView:
    """A paged store itself, as a native pass writes and attends in place: every layer's
    keys and values [L, slots, kvh, hd], and the blocks [B, nb] of a batch's rows."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    block_size: int


class ContextKV(Protocol):
    """A batch's cached keys and values, read one layer at a time."""

    def read(self, layer: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kvh, C, hd], C >= every row's context + ``extra``: a copy
        the caller may write into (positions past a row's context hold nothing)."""
        ...

    def paged(self, extra: int) -> PagedView | None:
        """The store in place, its table covering every row's context + ``extra``
        positions, which are the row's own to write (reserved for it); None where the
        context is no paged store."""
        ...


@dataclass(frozen=True)
class DenseKV:
    """Context keys and values held as dense tensors (tests, checks): [L, B, kvh, C, hd]."""

    k: torch.Tensor
    v: torch.Tensor

    def read(self, layer: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        return F.pad(self.k[layer], (0, 0, 0, extra)), F.pad(self.v[layer], (0, 0, 0, extra))

    def paged(self, extra: int) -> None:
        return None

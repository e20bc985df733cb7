"""Matrix products for the few-row forwards of decoding, on CPU.

A decoding step multiplies each weight by a handful of rows, and the weights
stream from memory once per step. On the CPU BLAS that torch ships, the layout of
such a product decides its speed (`treespark bench linear` times a pass over the
target's weights in each layout, side by side):

- ``W @ x^T`` with ``x`` row-major (``x^T`` a transposed view) is the fast one;
- ``F.linear`` (``x @ W^T``) is 2-3x slower at 2-8 rows;
- ``W @ X`` with ``X`` column-major is as slow, and that is what the *output* of
  ``(W @ x^T).T`` hands the next product unless it is made row-major again;
- one row runs as a matrix-vector product on a single thread, so it is padded to
  two rows, which run on every thread;
- 10-15 rows run slower than 16 (the AVX-512 width), so they are padded to 16.

``linear`` applies these rules to CPU products of up to ``SMALL_ROWS`` rows and
calls ``F.linear`` otherwise (more rows, where it is faster, or an accelerator).
The constants were measured on a two-core AVX-512 machine; the benchmark
re-measures them anywhere.

From three rows on, faster still, and nearly flat in the row count, is oneDNN's
matrix product on a weight reordered once into its blocked layout (``pack`` /
``packed_linear``; the op PyTorch's own CPU compiler emits for frozen linears).
It keeps a second copy of each packed weight, so the target's forward packs its
weights and the drafter (trained as well as served) uses ``linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS = 64  # at or below this many rows, CPU products run as W @ x^T
PACKED_MIN_ROWS = 3  # below this many rows, ``linear`` beats a packed weight


def padded_rows(n: int) -> int:
    """How many rows a CPU product of ``n`` rows runs with (``n`` <= ``SMALL_ROWS``)."""
    if n == 1:
        return 2
    if 10 <= n < 16:
        return 16
    return n


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape [..., in]; the result is row-major."""
    n = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if x.device.type != "cpu" or n == 0 or n > SMALL_ROWS:
        return F.linear(x, weight, bias)
    rows = x.reshape(n, x.shape[-1])
    m = padded_rows(n)
    if m > n:
        rows = torch.cat([rows, rows[:1].expand(m - n, -1)])
    y = (weight @ rows.contiguous().T).T[:n].contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class PackedWeight:
    """A float32 CPU weight [out, in] in oneDNN's blocked layout (a copy), with its bias."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``pack`` applies: a float32 CPU matrix and a PyTorch built with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """Reorder a copy of ``weight`` for ``packed_linear``; ValueError where ``can_pack`` is False."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} on "
                         f"{weight.device.type} (oneDNN available: {torch.backends.mkldnn.is_available()})")
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return PackedWeight(packed, None if bias is None else bias.detach(), weight.shape[0])


def packed_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """``F.linear`` with a packed weight, for ``x`` of shape [..., in] (no gradients)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, w.packed, w.bias, "none", [], "")
    return y.view(*x.shape[:-1], w.out_features)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose products go through ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

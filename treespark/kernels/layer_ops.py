"""A decoder layer's non-product operators, each in as few torch operators as its
reference maths allows: RMSNorm (Zhang and Sennrich, 2019) as transformers' Llama and
Qwen3 compute it, and rotary position embeddings (Su et al., 2021) in the half-split
layout of ``rotate_half``.

transformers' RMSNorm normalises in float32, casts back to the input's dtype, then
multiplies by its weight: ``rms_norm`` keeps that order (one ``F.rms_norm`` call in
float32, where the cast is the identity; the normalisation then the weight otherwise, so
that bf16 results are the same bits). ``rope`` is ``x cos + rotate_half(x) sin`` with
``rotate_half(x) sin`` computed as ``roll(x, D/2) * (sin with its first half negated)``:
negation is exact, so the values are transformers' to the bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D] (or any shape that broadcasts against ``x``, e.g.
    [H, D] for per-head weights over x [..., H, D]); normalised over the last dim."""
    if x.dtype == torch.float32 and weight.shape == x.shape[-1:]:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return F.rms_norm(x, x.shape[-1:], None, eps) * weight


def rope_sign(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[D]: -1 on the first half, +1 on the second: ``sin * rope_sign`` is what ``rope`` takes."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    half = head_dim // 2
    return torch.cat([torch.full((half,), -1.0), torch.ones(half)]).to(device=device, dtype=dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, K, D]; cos, signed_sin: [B, 1, K, D] (``signed_sin = sin * rope_sign``).
    Equals ``x * cos + rotate_half(x) * sin``."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

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

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treespark.kernels import blocks
from treespark.kernels.compile import compiled
from treespark.kernels.native import library


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


def residual_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)): a layer's residual add and the norm after it."""
    s = x + residual
    return s, rms_norm(s, weight, eps)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[N, 2I] -> [N, I]: ``act(gate) * up`` over gate|up stacked on the last dim; ``act``:
    a transformers ``hidden_act`` name in ``ACTIVATIONS``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def qk_norm_rope(y: torch.Tensor, b: int, k: int, heads: int, kv_heads: int, head_dim: int,
                 qk_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor):
    """The stacked q|k|v product's output y [B K, (Hq + 2 Hkv) D] as q [B, Hq, K, D] and
    k, v [B, Hkv, K, D]: Qwen3's q and k norms (per-head weight [Hq + Hkv, D]; None for a
    model without them) in one ``rms_norm``, q and k rotated in one ``rope``."""
    y = y.view(b, k, -1, head_dim)
    qk, v = y[:, :, :heads + kv_heads], y[:, :, heads + kv_heads:]
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, eps)
    qk = rope(qk.transpose(1, 2), cos, signed_sin)               # [B, Hq + Hkv, K, D]
    return qk[:, :heads], qk[:, heads:], v.transpose(1, 2)


# transformers' hidden_act names of the activations the fused forward runs (the functions
# transformers' own activation modules call)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


@dataclass(frozen=True)
class LayerOps:
    """The target forward's operators between its products and its attention, as plain
    functions (``EAGER``) or each compiled by ``torch.compile`` (``compiled_layer_ops``):
    on a GPU, one fused kernel per call instead of several."""

    rms_norm: Callable
    residual_rms_norm: Callable
    act_mul: Callable
    qk_norm_rope: Callable
    backend: str | None  # torch.compile's backend; None: not compiled


EAGER = LayerOps(rms_norm, residual_rms_norm, act_mul, qk_norm_rope, backend=None)


def _native(*ts: torch.Tensor) -> bool:
    """Whether ``blocks``' row functions take these tensors: contiguous float32 on the CPU,
    no gradient asked, the library built."""
    return (library() is not None and not torch.is_grad_enabled()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows [N, D] (itself where it is; a view otherwise)."""
    return x if x.dim() == 2 else x.view(-1, x.shape[-1])


def _shaped(y: torch.Tensor, *shape: int) -> torch.Tensor:
    return y if y.shape == shape else y.view(shape)


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` in one native call where it can (a weight over the last dim), else it."""
    if weight.shape != x.shape[-1:] or not _native(x, weight):
        return rms_norm(x, weight, eps)
    return _shaped(blocks.add_norm(_rows(x), None, weight, eps)[1], *x.shape)


def native_residual_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_rms_norm`` in one native call where it can, else it."""
    if weight.shape != x.shape[-1:] or x.shape != residual.shape or not _native(x, residual, weight):
        return residual_rms_norm(x, residual, weight, eps)
    s, normed = blocks.add_norm(_rows(x), _rows(residual), weight, eps)
    return _shaped(s, *x.shape), _shaped(normed, *x.shape)


def native_act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act_mul`` in one native call for silu, else it."""
    if act not in blocks.ACTIVATIONS or not _native(gate_up):
        return act_mul(gate_up, act)
    return _shaped(blocks.silu_rows(_rows(gate_up)), *gate_up.shape[:-1], gate_up.shape[-1] // 2)


def native_qk_norm_rope(y: torch.Tensor, b: int, k: int, heads: int, kv_heads: int, head_dim: int,
                        qk_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor):
    """``qk_norm_rope`` in one native call where it can: the q and k heads of ``y`` (the
    product's own output) normed and rotated in place, q, k and v returned as views of it."""
    cos, signed_sin = cos.reshape(b * k, head_dim), signed_sin.reshape(b * k, head_dim)
    if not _native(y, cos, signed_sin, *(() if qk_norm is None else (qk_norm,))):
        return qk_norm_rope(y, b, k, heads, kv_heads, head_dim, qk_norm, eps, cos.view(b, 1, k, head_dim),
                            signed_sin.view(b, 1, k, head_dim))
    blocks.qk_rope(y, qk_norm, eps, cos, signed_sin, heads, kv_heads, head_dim)
    y = y.view(b, k, -1, head_dim).transpose(1, 2)                   # [B, Hq + 2 Hkv, K, D]
    return y[:, :heads], y[:, heads:heads + kv_heads], y[:, heads + kv_heads:]


# the CPU's: the eager operators' maths, each in one native call over the rows (blocks.c:
# the functions its decoding blocks run), the eager operators where a call cannot take its
# tensors (an accelerator, bfloat16, another activation, gradients)
NATIVE_OPS = LayerOps(native_rms_norm, native_residual_rms_norm, native_act_mul, native_qk_norm_rope, backend=None)


def compiled_layer_ops(backend: str = "inductor") -> LayerOps:
    """``LayerOps`` compiled by ``torch.compile(backend=backend)`` (``treespark.kernels.compile``).
    ``inductor`` generates the kernels (Triton on a GPU, C++ on a CPU); ``aot_eager``
    traces the same graphs and runs them on torch's own kernels (what the test suite
    checks the traced engine with, in seconds)."""
    return LayerOps(*(compiled(f, backend) for f in (rms_norm, residual_rms_norm, act_mul, qk_norm_rope)),
                    backend=backend)

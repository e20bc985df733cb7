"""The drafter's rotary position embedding (rotate-half convention), from its config."""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RopeConfig(Protocol):
    """What the rotary embedding reads of a config (``DSparkConfig`` has it)."""

    hidden_size: int
    num_attention_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D]; cos, sin: [B, S, D] (rotate-half convention)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class Rotary:
    """The drafter's rotary embedding, from its config: theta, and the scaling (linear,
    yarn, llama3, longrope, ...) exactly as transformers computes it for a target with
    the same ``rope_parameters``. The inverse frequencies stay float32 on every device
    (a plain attribute, not a buffer: casting the drafter to bfloat16 leaves them).
    Dynamic NTK scaling, which changes with the sequence length, is refused."""

    def __init__(self, c: RopeConfig) -> None:
        params = dict(c.rope_scaling or {})
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        with torch.device("cpu"):  # also when the drafter itself is built on the meta device
            if rope_type == "default":
                d = c.head_dim
                inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
                self.scale = 1.0
            elif rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"drafter rope_type {rope_type!r} is not supported "
                                 f"(supported: default, {', '.join(k for k in ROPE_INIT_FUNCTIONS if k != 'dynamic')})")
            else:
                cfg = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                  head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                                  rope_parameters={"rope_type": rope_type, "rope_theta": c.rope_theta, **params})
                inv_freq, self.scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        self._inv_freq = {torch.device("cpu"): inv_freq.float()}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> cos, sin [B, S, head_dim] in ``dtype``."""
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq[positions.device] = self._inv_freq[torch.device("cpu")].to(positions.device)
        freqs = positions.to(torch.float32)[..., None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:          # (a scale of 1 and a float32 dtype call no operator: the same values)
            cos, sin = cos * self.scale, sin * self.scale
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

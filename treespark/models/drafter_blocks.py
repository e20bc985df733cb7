"""The drafter's block pass on the native blocks (``treespark.kernels.blocks``).

At the rows of a CPU drafting step (one block of ``block_size`` rows a request, up to
``MAX_ROWS`` in all) the drafter's layers run as the target's do: ``attn_in`` and
``attn_out_mlp`` around an attention over the layer's context keys and values, with the
block's own written into them. The values are the torch layers' to float rounding
(``tests/models/test_drafter_blocks.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from treespark.kernels import blocks, native
from treespark.kernels.attention import ContextKV, grouped_attention
from treespark.kernels.layer_ops import rope_sign
from treespark.models.drafter_config import DSparkConfig

# (context, layer, ctx_len, bias or None, dtype) -> the layer's context keys and values, a
# copy with room for the block, and the block's bias (``DSparkDrafter._context_layer``)
ContextLayer = Callable[[ContextKV, int, torch.Tensor, torch.Tensor | None, torch.dtype],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def layer_weights(layer: nn.Module, c: DSparkConfig) -> tuple[blocks.LayerWeights, bool]:
    """A drafter layer's weights as ``treespark.kernels.blocks`` takes them (q|k|v and
    gate|up stacked, the q/k norms per head, no biases), and whether all four products
    read their exact bfloat16 panels (a drafter stored in bfloat16) rather than float32."""
    a = layer.self_attn
    full = (torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous(),
            a.o_proj.weight.detach(),
            torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach().contiguous(),
            layer.mlp.down_proj.weight.detach())
    panels = [native.exact_panels(w) for w in full]
    half = all(p is not None for p in panels)
    qkv, o, gate_up, down = panels if half else full
    eps = c.rms_norm_eps
    qk_norm = blocks.qk_norm_weight(a.q_norm.weight, a.k_norm.weight, c.num_attention_heads, c.num_key_value_heads)
    return blocks.LayerWeights(layer.input_layernorm.weight.detach(), eps, qkv, None, qk_norm, eps, o, None,
                               layer.post_attention_layernorm.weight.detach(), eps, gate_up, None, down, None), half


class NativeBlockPass:
    """A drafter's block pass on the native blocks, and the stacked weights it reads."""

    def __init__(self, config: DSparkConfig) -> None:
        self.config = config
        # (the layers, their parameters, each one's storage and version, ``fused_layers``)
        self._fused: tuple[nn.ModuleList, list[nn.Parameter], list[tuple[int, int]],
                           list[tuple[blocks.LayerWeights, bool]]] | None = None
        with torch.device("cpu"):   # CPU float32 only: made once, not per pass
            self._rope_sign = rope_sign(config.head_dim, torch.device("cpu"), torch.float32)

    def runs(self, x: torch.Tensor) -> bool:
        """Whether the block pass of ``x`` [B, blk, h] runs here: float32 on the CPU, at
        most ``MAX_ROWS`` rows, no gradients, the library built."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()
                and blocks.can_run(x.shape[0] * x.shape[1], self.config.hidden_act))

    def fused_layers(self, layers: nn.ModuleList) -> list[tuple[blocks.LayerWeights, bool]]:
        """Each layer's weights as ``blocks`` takes them (q|k|v and gate|up stacked, the q/k
        norms per head): made once, again when a weight changes in place (a load, a training
        step, a move) or other layers come. The parameters are listed when made, so a step
        checks their versions without walking the modules (~0.1 ms a step)."""
        f = self._fused
        if f is None or f[0] is not layers or [(p.data_ptr(), p._version) for p in f[1]] != f[2]:
            params = list(layers.parameters())
            f = self._fused = (layers, params, [(p.data_ptr(), p._version) for p in params],
                               [layer_weights(layer, self.config) for layer in layers])
        return f[3]

    def __call__(self, layers: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 context: ContextKV, ctx_len: torch.Tensor, positions: torch.Tensor,
                 context_layer: ContextLayer) -> torch.Tensor:
        """The block's last hidden states [B, blk, h] from its embeddings ``x`` [B, blk, h]:
        per layer two native calls around its attention over ``context_layer``'s keys and
        values, the block's own written at ``positions`` [B, blk]."""
        c = self.config
        b, blk, h = x.shape
        hq, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos = cos.reshape(b * blk, hd).contiguous()
        ssin = (sin * self._rope_sign).reshape(b * blk, hd).contiguous()
        x = x.reshape(b * blk, h).contiguous()
        mlp = bias = None
        for i, (w, half) in enumerate(self.fused_layers(layers)):
            x, y = blocks.attn_in(x, mlp, w.in_norm, w.in_eps, w.wqkv, w.bqkv, half, w.qk_norm, w.qk_eps, cos, ssin,
                                  hq, hkv, hd)
            y = y.view(b, blk, -1, hd).transpose(1, 2)                        # [B, Hq + 2 Hkv, blk, hd]
            k, v, bias = context_layer(context, i, ctx_len, bias, x.dtype)
            at = positions[:, None, :, None].expand(b, hkv, blk, hd)
            k.scatter_(2, at, y[:, hq:hq + hkv].to(k.dtype))
            v.scatter_(2, at, y[:, hq + hkv:].to(v.dtype))
            out = grouped_attention(y[:, :hq], k.to(x.dtype), v.to(x.dtype), bias)   # [B, Hq, blk, hd]
            a = out.transpose(1, 2).reshape(b * blk, -1).contiguous()
            x, mlp = blocks.attn_out_mlp(a, w.wo, w.bo, x, w.post_norm, w.post_eps, w.wgu, w.bgu, w.wdown, w.bdown,
                                         half)
        return (x + mlp).view(b, blk, h)

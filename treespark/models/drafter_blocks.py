"""The drafter's block pass on the native blocks (``treespark.kernels.blocks``).

At the rows of a CPU drafting step (one block of ``block_size`` rows a request, up to
``MAX_ROWS`` in all) the drafter's layers run as the target's do: ``attn_in`` and
``attn_out_mlp`` around an attention over the layer's context keys and values, with the
block's own written into them. Over a paged store (the engine's, ``ContextKV.paged``)
the whole pass is one ``blocks.layers`` call, as a decoding step's target forward is:
the block's keys and values written at its rows' next positions in the store itself
(the engine reserves them; the commit writes the kept positions' context over them) and
attended in place, where the per-layer pass copies each layer's context to write them
into. The context's keys and values (``context_kv``: every layer's from the committed
positions' taps) are one ``blocks.attn_in`` call at those rows too, every layer's k and v
products stacked into one, with no query heads; at a prefill's hundreds of rows, the
norm and the rotation are one native call each around torch's product (float32 weights).
The values are the torch layers' to float rounding (``tests/models/test_drafter_blocks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treespark.kernels import blocks, native
from treespark.kernels.attention import ContextKV, PagedView, grouped_attention
from treespark.kernels.layer_ops import rope_sign
from treespark.kernels.native import as_long
from treespark.models.drafter_config import DSparkConfig
from treespark.models.rotary import Rotary

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


def context_weights(layers: nn.ModuleList, c: DSparkConfig) -> ContextWeights:
    """Every layer's k and v products as one (``ContextWeights``)."""
    attn = [layer.self_attn for layer in layers]
    w = torch.cat([a.k_proj.weight for a in attn] + [a.v_proj.weight for a in attn]).detach().contiguous()
    panels = native.exact_panels(w)
    k_norm = torch.cat([a.k_norm.weight.detach().expand(c.num_key_value_heads, -1) for a in attn]).contiguous()
    return ContextWeights(w if panels is None else panels, panels is not None, k_norm)


@dataclass(frozen=True)
class ContextWeights:
    """The context's keys and values of every layer in one product: k and v weights
    stacked [L kvh hd (every layer's k) + L kvh hd (every layer's v), h] (float32, or the
    exact bfloat16 panels, ``half``), and the k norms per head [L kvh, hd]."""

    w: torch.Tensor
    half: bool
    k_norm: torch.Tensor


class NativeBlockPass:
    """A drafter's block pass on the native blocks, and the stacked weights it reads."""

    def __init__(self, config: DSparkConfig) -> None:
        self.config = config
        # (the layers, their parameters, each one's storage and version, ``fused_layers``, ``context_weights``)
        self._fused: tuple[nn.ModuleList, list[nn.Parameter], list[tuple[int, int]],
                           list[tuple[blocks.LayerWeights, bool]], ContextWeights] | None = None
        with torch.device("cpu"):   # CPU float32 only: made once, not per pass
            self._rope_sign = rope_sign(config.head_dim, torch.device("cpu"), torch.float32)
        self._stack: tuple[tuple, blocks.LayerStack] | None = None   # (what it was made for, ``_paged_stack``)
        self._rope: tuple[Rotary, torch.Tensor, torch.Tensor] | None = None   # ``rope_tables``

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy`` of a drafter, pickling) starts without the made weights,
        tables and the store's pointers (ctypes arrays pickle as nothing): it makes its own."""
        return {**self.__dict__, "_fused": None, "_stack": None, "_rope": None}

    def rope_tables(self, rotary: Rotary, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin (``rope_sign`` applied) [P, hd] of positions 0 .. P - 1, P
        >= ``n``, float32 on the CPU, each position's as ``rotary`` computes it: made once,
        grown (at least doubling) when a pass reaches past them, so a step looks its
        positions up where it computed them (~8 operators)."""
        t = self._rope
        if t is None or t[0] is not rotary or t[1].shape[0] < n:
            p = max(n, 1024 if t is None or t[0] is not rotary else 2 * t[1].shape[0])
            cos, sin = rotary(torch.arange(p)[None], torch.float32)
            t = self._rope = (rotary, cos[0].contiguous(), (sin[0] * self._rope_sign).contiguous())
        return t[1], t[2]

    def runs(self, block: torch.Tensor) -> bool:
        """Whether the block pass of a block [B, blk] (its tokens, or [B, blk, h] its
        embeddings) of a float32 drafter (the caller's to say) runs here: on the CPU, at most
        ``MAX_ROWS`` rows, no gradients, the library built."""
        return (block.device.type == "cpu" and not torch.is_grad_enabled()
                and blocks.can_run(block.shape[0] * block.shape[1], self.config.hidden_act))

    def fused_layers(self, layers: nn.ModuleList) -> list[tuple[blocks.LayerWeights, bool]]:
        """Each layer's weights as ``blocks`` takes them (q|k|v and gate|up stacked, the q/k
        norms per head): made once, again when a weight changes in place (a load, a training
        step, a move) or other layers come. The parameters are listed when made, so a step
        checks their versions without walking the modules (~0.1 ms a step)."""
        return self._made(layers)[3]

    def _made(self, layers: nn.ModuleList):
        f = self._fused
        if f is None or f[0] is not layers or [(p.data_ptr(), p._version) for p in f[1]] != f[2]:
            params = list(layers.parameters())
            f = self._fused = (layers, params, [(p.data_ptr(), p._version) for p in params],
                               [layer_weights(layer, self.config) for layer in layers],
                               context_weights(layers, self.config))
        return f

    def runs_context(self, layers: nn.ModuleList, x: torch.Tensor) -> bool:
        """Whether ``context_kv`` takes the rows of ``x`` [..., h]: float32 on the CPU, no
        gradients, the library built; past the blocks' rows (a prefill's) where the product
        is a float32 weight's (torch's, around the native norms and rotation)."""
        if not self._native_rows(x):
            return False
        cw = self._made(layers)[4]
        return self._in_one_call(cw, x.numel() // x.shape[-1]) or not cw.half

    def _native_rows(self, x: torch.Tensor) -> bool:
        """Whether the native calls take the rows ``x``: float32 on the CPU, no gradients, the library built."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()
                and blocks.can_run(1, self.config.hidden_act))

    def _in_one_call(self, cw: ContextWeights, rows: int) -> bool:
        """Whether ``rows`` context rows take one ``attn_in`` call (the blocks' rows; any on AMX tiles)."""
        return blocks.can_run(rows, self.config.hidden_act, cw.half and native.most_rows(cw.w) is None)

    def write_context(self, layers: nn.ModuleList, x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      rotary: Rotary, positions: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                      slots: torch.Tensor) -> bool:
        """``context_kv`` of the rows ``x`` [N, h] (``positions`` [N]) written at ``slots``
        [N] of a paged store's keys and values [L, S, kvh, hd], in one native call
        (``blocks.context_write``), where the rows take one call (a commit's few) and the
        store is float32 on the CPU; False where not (nothing written: the caller's to)."""
        c = self.config
        if not self._native_rows(x):
            return False
        cw = self._made(layers)[4]
        if not (self._in_one_call(cw, x.shape[0]) and store_k.dtype == torch.float32 and store_k.device.type == "cpu"
                and store_k.is_contiguous() and store_v.is_contiguous() and store_k.shape[0] == len(layers)):
            return False
        x, positions, slots = x.contiguous(), as_long(positions), as_long(slots)
        cos, ssin = self.rope_tables(rotary, 0)
        args = (x, norm_w, eps, cw.w, cw.half, cw.k_norm, c.rms_norm_eps)
        if not blocks.context_write(*args, cos, ssin, positions, slots, store_k, store_v):   # a position past the tables
            cos, ssin = self.rope_tables(rotary, int(positions.max()) + 1)
            assert blocks.context_write(*args, cos, ssin, positions, slots, store_k, store_v)
        return True

    def context_kv(self, layers: nn.ModuleList, x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's keys and values [L, B, kvh, S, hd] of the context rows ``x`` [B, S,
        h] before their norm (``norm_w``, ``eps``: the drafter's hidden norm), ``cos``,
        ``sin`` [B, S, hd]: one ``attn_in`` call (views of its output); past its rows the
        norm, torch's product and the k norms and rotation, each one call."""
        c = self.config
        b, s, h = x.shape
        hkv, hd, n_layers = c.num_key_value_heads, c.head_dim, len(layers)
        cw = self._made(layers)[4]
        rows = x.reshape(b * s, h).contiguous()
        cos = cos.reshape(b * s, hd).contiguous()
        ssin = (sin * self._rope_sign).reshape(b * s, hd).contiguous()
        if self._in_one_call(cw, b * s):
            _, y = blocks.attn_in(rows, None, norm_w, eps, cw.w, None, cw.half, cw.k_norm, c.rms_norm_eps, cos, ssin,
                                  0, n_layers * hkv, hd)
        else:
            y = F.linear(blocks.add_norm(rows, None, norm_w, eps)[1], cw.w)
            blocks.qk_rope(y, cw.k_norm, c.rms_norm_eps, cos, ssin, 0, n_layers * hkv, hd)
        kv = y.view(b, s, 2, n_layers, hkv, hd).permute(2, 3, 0, 4, 1, 5)          # [2, L, B, kvh, S, hd]
        return kv[0], kv[1]

    def __call__(self, layers: nn.ModuleList, ids: torch.Tensor, embed: torch.Tensor, rotary: Rotary,
                 context: ContextKV, ctx_len: torch.Tensor, positions: torch.Tensor,
                 context_layer: ContextLayer) -> torch.Tensor:
        """The block's last hidden states [B, blk, h] from its tokens ``ids`` [B, blk] (rows
        of ``embed`` [V, h]) at ``positions`` [B, blk]: one ``blocks.layers`` call where the
        context is a paged store it takes and the table float32 (the embeddings and the
        rotation looked up there, from ``rope_tables``), else per layer two native calls
        around its attention over ``context_layer``'s keys and values, the block's own
        written at ``positions``."""
        c = self.config
        b, blk = ids.shape
        h = embed.shape[1]
        hq, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        view = context.paged(blk)
        stack = None if view is None else self._paged_stack(layers, view)
        if stack is not None and embed.dtype == torch.float32 and embed.is_contiguous():
            assert view is not None
            bs, table = view.block_size, view.table
            # each block token written at its position, seeing its row's context and the block
            x, _ = blocks.layers(stack, ids.flatten(), embed, *self.rope_tables(rotary, table.shape[1] * bs),
                                 positions.flatten(), None, table, bs, None, hd ** -0.5, lens=ctx_len + blk)
            return x.view(b, blk, h)
        x = F.embedding(ids, embed).float().view(b * blk, h)
        cos, sin = rotary(positions, x.dtype)
        cos = cos.reshape(b * blk, hd).contiguous()
        ssin = (sin * self._rope_sign).reshape(b * blk, hd).contiguous()
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

    def _paged_stack(self, layers: nn.ModuleList, view: PagedView) -> blocks.LayerStack | None:
        """The layers and ``view``'s store as ``blocks.layers`` takes them, where it takes
        them (a float32 store on the CPU, every layer's products in one precision); None
        elsewhere. Made once per store and weights; only the last is kept."""
        fused = self.fused_layers(layers)
        halves = {half for _, half in fused}
        if not (len(halves) == 1 and view.k.dtype == view.v.dtype == torch.float32 and view.k.device.type == "cpu"
                and view.k.is_contiguous() and view.v.is_contiguous() and view.k.shape[0] == len(fused)):
            return None
        key = (view.k, view.v, fused)
        if self._stack is None or any(a is not b for a, b in zip(self._stack[0], key, strict=True)):
            c = self.config
            self._stack = key, blocks.LayerStack([w for w, _ in fused], view.k, view.v, halves.pop(),
                                                 c.num_attention_heads, c.num_key_value_heads, c.head_dim, ())
        return self._stack[1]

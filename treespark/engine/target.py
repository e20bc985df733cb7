"""The target model's forward for speculative decoding, over a transformers model.

One call verifies a batch of draft trees: each row holds a request's tree (padded),
attends to its own committed KV and to its tree ancestors (a 4D mask), writes its
tree's keys/values into its KV row, and returns the logits at every tree node plus
the hidden states of the layers the drafter taps.

We run the transformers model's own weights (embeddings, rotary embedding, norms'
weights) through a small forward of our own instead of ``model(...)``: it writes into
our KV store, computes logits only where needed, and launches few operators: four
products a layer (q|k|v and gate|up stacked, ``treespark.engine.products``), each
RMSNorm one ``F.rms_norm`` and rotary embeddings one pass over q and k together
(``treespark.kernels.layer_ops``). On CPU each product runs in the layout a product
plan picks for its row count (``product_plan``; pass ``products`` to fix it instead).
``fused=False`` runs the reference instead (the separate products, transformers' norm
modules, ``rotate_half``): the same values to float rounding, for ``treespark bench ops``.

Supported: the Llama family (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with
q/k norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treespark.engine.attend import LayerAttention, prefill_rows, stacked, store_attention
from treespark.engine.kv import KVStore, PagedRows, PagedStore, StoreShape
from treespark.engine.products import (
    LayerProducts,
    ModelProducts,
    Product,
    model_products,
    packable,
    product_plan,
)
from treespark.kernels import blocks
from treespark.kernels.attention import AttentionPath
from treespark.kernels.layer_ops import (
    ACTIVATIONS,
    EAGER,
    NATIVE_OPS,
    compiled_layer_ops,
    rope_sign,
)
from treespark.kernels.linear import F_LINEAR, HALF, NATIVE, PACKED, ProductPlan, planned_linear
from treespark.kernels.native import can_run as native_can_run
from treespark.kernels.native import most_rows


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


def _weight(p: Product, half: bool) -> torch.Tensor:
    """The weight a native block multiplies by: the bfloat16 copy (``half``) or the float32 one."""
    w = p.half if half else p.weight
    assert w is not None and w.is_contiguous(), "the plan's layout needs this weight's contiguous copy"
    return w


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [B, K, V] float32 ([B, 1, V] for "last"; None for "none")
    taps: torch.Tensor           # [B, K, n_taps * hidden] the tapped layers' outputs


class TargetRunner:
    """Runs a transformers causal LM (Llama family) against a ``KVStore``."""

    def __init__(self, model: PreTrainedModel, tap_layers: tuple[int, ...],
                 products: ProductPlan | None = None, fused: bool = True,
                 attention: AttentionPath = AttentionPath.GROUPED, compile_backend: str | None = None,
                 max_positions: int | None = None) -> None:
        """``products``: the CPU product layout per row count (default: ``product_plan``,
        timed on this machine); ignored off CPU. ``fused``: the fused forward (False: the
        reference, separate products and transformers' norm modules). ``attention``: the
        attention path (``treespark.kernels.attention``; the reference is the plain gather
        + SDPA). ``compile_backend``: the fused forward's norms, rotary embeddings and
        activation compiled by ``torch.compile`` with this backend (``inductor``, ...;
        ``treespark.kernels.layer_ops.compiled_layer_ops``); None: not compiled.
        ``max_positions``: the positions a forward may hold (default: the model's
        ``max_position_embeddings``), whose rotary cos and sin are made once, in a table
        a forward looks its positions up in (``_rotary``)."""
        self.model = model
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise ValueError(f"{type(model).__name__} is not a Llama-family causal LM")
        self.base = base
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        for i in tap_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"tap layer {i} outside the target's {self.num_layers} layers")
        self.tap_layers = tuple(tap_layers)
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_heads = cfg.num_attention_heads
        self.attention = attention
        self.scaling = attn.scaling
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.fused = fused
        if compile_backend is not None and not fused:
            raise ValueError("the compiled forward is the fused one: compile_backend needs fused=True")
        # (a CPU's forward runs its norms, rotation and activation natively, over any rows)
        self.ops = (compiled_layer_ops(compile_backend) if compile_backend is not None
                    else NATIVE_OPS if self.device.type == "cpu" else EAGER)
        self.act = getattr(cfg, "hidden_act", "silu")
        if fused and self.act not in ACTIVATIONS:
            raise ValueError(f"the fused forward runs {sorted(ACTIVATIONS)}, not hidden_act={self.act!r}")
        if fused:
            self._rope_sign = rope_sign(self.head_dim, self.device, self.dtype)   # [D]
            self._qk_norms = [self._qk_norm(layer.self_attn) for layer in base.layers]
        self._rope = self._rope_table(max_positions or cfg.max_position_embeddings)
        # on CPU: which layout each row count runs in (treespark.kernels.linear), and a copy of
        # every product weight in oneDNN's layout (or in bfloat16) where the plan multiplies by one
        self.products: ProductPlan | None = None
        packed = half = False
        if self.device.type == "cpu":
            self.products = products or product_plan(model)
            packed, half = PACKED in self.products.layouts, HALF in self.products.layouts
            if packed and not packable(model):
                raise ValueError(f"product plan {self.products.describe()!r} needs packed weights, and this "
                                 f"{self.dtype} model has none (oneDNN: {torch.backends.mkldnn.is_available()})")
        self.weights: ModelProducts = model_products(model, fused, packed, half)
        # the layers of a few-row forward on the native blocks where the plan runs its rows
        # on gemv.c (``_on_blocks``): the fused eager forward of float32 activations only
        self._blocks = (self.products is not None and fused and compile_backend is None
                        and self.dtype == torch.float32)
        # each layer's weights as the native blocks take them, by half (``_block_weights``), and
        # the last paged store's layer stacks for ``blocks.layers``, by half (``_stack``)
        self._block_weights_by: dict[bool, list[blocks.LayerWeights]] = {}
        self._tiles: bool | None = None   # ``_half_tiles``
        self._stacks: tuple[PagedStore | None, dict[bool, blocks.LayerStack]] = (None, {})

    def _rope_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary cos and sin [n, D] of positions 0 .. n - 1, in the forward's dtype
        (sin with ``rope_sign`` applied for the fused forward), from the model's own
        rotary embedding: each position's values are the ones it computes for that
        position alone. None where they are not (dynamic and longrope scaling: they
        change with the longest position in the batch)."""
        rotary = self.base.rotary_emb
        if "dynamic" in str(getattr(rotary, "rope_type", "default")) or getattr(rotary, "rope_type", "") == "longrope":
            return None
        cos, sin = rotary(torch.zeros(1, dtype=self.dtype, device=self.device),
                          torch.arange(n, device=self.device)[None])
        cos, sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        return cos, sin * self._rope_sign if self.fused else sin

    def _rotary(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, K, D] of ``positions`` [B, K] (sin with ``rope_sign`` applied in
        the fused forward): looked up in the table where there is one, else computed."""
        if self._rope is not None:
            return self._rope[0][positions][:, None], self._rope[1][positions][:, None]
        cos, sin = self.base.rotary_emb(h, positions)
        cos, sin = cos[:, None].to(self.dtype), sin[:, None].to(self.dtype)   # [B, 1, K, D]
        return cos, sin * self._rope_sign if self.fused else sin

    def _qk_norm(self, attn: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
        """Qwen3's q and k norms as one per-head weight [Hq + Hkv, D] and their eps (None
        for a model without them)."""
        if not hasattr(attn, "q_norm"):
            return None
        eps = attn.q_norm.variance_epsilon
        if attn.k_norm.variance_epsilon != eps:
            raise ValueError(f"q_norm and k_norm with different eps ({eps}, {attn.k_norm.variance_epsilon})")
        return blocks.qk_norm_weight(attn.q_norm.weight, attn.k_norm.weight, self.num_heads, self.num_kv_heads), eps

    @property
    def products_described(self) -> str | None:
        """The product plan in words (``ProductPlan.describe``); None off CPU."""
        return None if self.products is None else self.products.describe()

    @property
    def store_shape(self) -> StoreShape:
        return StoreShape(self.num_layers, self.num_kv_heads, self.head_dim)

    def _linear(self, x: torch.Tensor, p: Product) -> torch.Tensor:
        """x: [N, in] -> [N, out] (row-major), in the plan's layout for N rows."""
        return planned_linear(x, p.weight, p.bias, self.products, p.packed, p.half)

    def _qkv(self, lp: LayerProducts, idx: int, x: torch.Tensor, cos, sin, b: int, k: int):
        """q [B, Hq, K, D], k and v [B, Hkv, K, D], q and k rotated: one stacked product,
        Qwen3's q/k norms and the rotation in ``qk_norm_rope``."""
        norm, eps = self._qk_norms[idx] or (None, 0.0)
        return self.ops.qk_norm_rope(self._linear(x, lp.qkv[0]), b, k, self.num_heads, self.num_kv_heads,
                                     self.head_dim, norm, eps, cos, sin)

    def _qkv_reference(self, attn, lp: LayerProducts, x: torch.Tensor, cos, sin, b: int, k: int):
        q, kk, vv = (self._linear(x, p).view(b, k, -1, self.head_dim) for p in lp.qkv)
        if hasattr(attn, "q_norm"):
            q, kk = attn.q_norm(q), attn.k_norm(kk)
        q, kk, vv = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        kk = kk * cos + _rotate_half(kk) * sin
        return q, kk, vv

    def _attention(self, layer, lp, x, cos, sin, idx, attend: LayerAttention, b, k):
        attn = layer.self_attn
        if self.fused:
            q, kk, vv = self._qkv(lp, idx, x, cos, sin, b, k)
        else:
            q, kk, vv = self._qkv_reference(attn, lp, x, cos, sin, b, k)
        attend.write(idx, kk, vv)
        out = attend(idx, q)                                                 # [B, H, K, hd]
        return self._linear(out.transpose(1, 2).reshape(b * k, -1), lp.o)

    def _mlp(self, mlp, lp: LayerProducts, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self._linear(self.ops.act_mul(self._linear(x, lp.gate_up[0]), self.act), lp.down)
        gate, up = (self._linear(x, p) for p in lp.gate_up)
        return self._linear(mlp.act_fn(gate) * up, lp.down)

    def _norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, module.weight, module.variance_epsilon) if self.fused else module(x)

    def _add_norm(self, module: torch.nn.Module, x: torch.Tensor, r: torch.Tensor):
        """(x + r, the norm of it)."""
        if self.fused:
            return self.ops.residual_rms_norm(x, r, module.weight, module.variance_epsilon)
        x = x + r
        return x, module(x)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,      # [B, K] input ids
        positions: torch.Tensor,   # [B, K] position ids (a tree node's: root position + depth)
        write_pos: torch.Tensor,   # [B, K] where each token's keys/values go in its KV row
        store: KVStore | PagedStore,
        rows: slice | PagedRows,   # the batch's rows of a dense store, or its block tables' slots
        mask: torch.Tensor,        # [B, 1, K, T] bool: True = may attend (T >= every position + 1)
        logits_for: str | torch.Tensor = "all",  # as ``run``
        logits_into: torch.Tensor | None = None,  # as ``run``
    ) -> ForwardOutput:
        """A batch of rows padded to one width over a store (``StoreAttention``)."""
        attend = store_attention(self.attention, store, rows, write_pos, mask, groups=self.groups,
                                 dtype=self.dtype, scale=self.scaling)
        return self.run(tokens, positions, attend, logits_for, logits_into)

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @torch.no_grad()
    def run(
        self,
        tokens: torch.Tensor,      # [B, K] input ids
        positions: torch.Tensor,   # [B, K] position ids
        attend: LayerAttention,    # writes each layer's keys and values, and attends
        logits_for: str | torch.Tensor = "all",  # "all" nodes, the "last" one of each row, "none",
                                                 # or [F] indices into the B * K tokens (logits [F, 1, V])
        logits_into: torch.Tensor | None = None,  # flat float32 memory the logits may be written
                                                  # into (valid until the next call; ``_head``)
    ) -> ForwardOutput:
        """The forward over any ``LayerAttention`` (``treespark.engine.attend``)."""
        x, tapped = self.layers(tokens, positions, attend)
        return ForwardOutput(logits=self.logits(x, logits_for, logits_into), taps=tapped)

    @torch.no_grad()
    def layers(self, tokens: torch.Tensor, positions: torch.Tensor,
               attend: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over tokens and positions [B, K]: each layer's new keys and
        values are written, and its attention run, through ``attend``. Returns the last
        layer's output [B, K, h] (before the final norm) and the tapped layers' [B, K,
        n_taps * h]. Shapes come from the inputs only, and nothing here waits for the
        device: the part ``treespark.engine.graphs`` captures."""
        b, k = tokens.shape
        half = self._on_blocks(b * k, prefill_rows(attend))
        embed = self.base.embed_tokens.weight
        if (half is not None and self._rope is not None and embed.dtype == torch.float32 and embed.is_contiguous()
                and (one := stacked(attend)) is not None):   # the whole stack in one call, lookups included
            x, tapped = blocks.layers(self._stack(one.store, half), tokens.flatten(), embed, *self._rope,
                                      positions.flatten(), one.slots, one.table, one.block_size, one.mask, one.scale,
                                      one.chunks)
            return x.view(b, k, -1), tapped.view(b, k, -1)
        h = self.base.embed_tokens(tokens).to(self.dtype)                  # [B, K, h]
        cos, sin = self._rotary(h, positions)                                # [B, 1, K, D]
        x = h.reshape(b * k, -1)
        if half is None:
            x, mlp_out, taps = self._torch_layers(x, cos, sin, attend, b, k)
        else:
            x, mlp_out, taps = self._block_layers(x, cos, sin, attend, b, k, half)
        x = x + mlp_out
        taps[self.num_layers - 1] = x
        tapped = torch.cat([taps[i] for i in self.tap_layers], dim=-1).view(b, k, -1)
        return x.view(b, k, -1), tapped

    def _torch_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: LayerAttention,
                      b: int, k: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """``layers``' loop on torch operators: the residual stream [B K, h] after the last
        layer's attention, that layer's MLP output (each layer's is added to the stream in
        the next layer's first norm) and the tapped layers' outputs by index."""
        taps: dict[int, torch.Tensor] = {}
        mlp_out = None
        for idx, (layer, lp) in enumerate(zip(self.base.layers, self.weights.layers, strict=True)):
            if mlp_out is None:
                normed = self._norm(layer.input_layernorm, x)
            else:
                x, normed = self._add_norm(layer.input_layernorm, x, mlp_out)
                if idx - 1 in self.tap_layers:
                    taps[idx - 1] = x
            a = self._attention(layer, lp, normed, cos, sin, idx, attend, b, k)
            x, normed = self._add_norm(layer.post_attention_layernorm, x, a)
            mlp_out = self._mlp(layer.mlp, lp, normed)
        return x, mlp_out, taps

    def _on_blocks(self, rows: int, prefill: int = 0) -> bool | None:
        """Whether a forward of ``rows`` rows (``prefill`` of them a packed prefill's) runs
        its layers on the native blocks (``treespark.kernels.blocks``: where the plan runs
        these rows on ``gemv.c``, in the fused eager forward of float32 activations) and if
        so on the bfloat16 copies; None where it does not."""
        if not self._blocks:
            return None
        layout = self.products.layout(rows)
        tiles = layout == HALF and rows > blocks.MAX_ROWS and self._half_tiles()
        if layout not in (NATIVE, HALF) or not blocks.can_run(rows, self.act, tiles, prefill):
            return None
        return layout == HALF

    def _half_tiles(self) -> bool:
        """Whether the layers' bfloat16 copies are all AMX tiles (``blocks.all_tiles``), once."""
        if self._tiles is None:
            self._tiles = blocks.all_tiles(self._block_weights(True))
        return self._tiles

    def _stack(self, store: PagedStore, half: bool) -> blocks.LayerStack:
        """The layers and ``store`` as one native call takes them (``blocks.layers``), for a
        forward whose attention it takes (``treespark.engine.attend.stacked``: a decoding
        step's trees, a packed prefill's chunks, or both). Made once per store and weight
        copy; only the last store's are kept."""
        if self._stacks[0] is not store:
            self._stacks = (store, {})
        made = self._stacks[1]
        if half not in made:
            made[half] = blocks.LayerStack(self._block_weights(half), store.k, store.v, half, self.num_heads,
                                           self.num_kv_heads, self.head_dim, self.tap_layers)
        return made[half]

    def _block_weights(self, half: bool) -> list[blocks.LayerWeights]:
        """Each layer's weights as the native blocks take them (``half``: the bfloat16
        copies), made once."""
        if half not in self._block_weights_by:
            out = []
            for idx, (layer, lp) in enumerate(zip(self.base.layers, self.weights.layers, strict=True)):
                (qkv,), (gu,) = lp.qkv, lp.gate_up
                norm, eps = self._qk_norms[idx] or (None, 0.0)
                inorm, pnorm = layer.input_layernorm, layer.post_attention_layernorm
                out.append(blocks.LayerWeights(
                    inorm.weight.detach(), inorm.variance_epsilon, _weight(qkv, half), qkv.bias, norm, eps,
                    _weight(lp.o, half), lp.o.bias, pnorm.weight.detach(), pnorm.variance_epsilon,
                    _weight(gu, half), gu.bias, _weight(lp.down, half), lp.down.bias))
            self._block_weights_by[half] = out
        return self._block_weights_by[half]

    def _block_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: LayerAttention,
                      b: int, k: int, half: bool) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """``_torch_layers`` on the native blocks, two calls a layer around its attention
        (``half``: on the bfloat16 copies): the fused forward's values to float rounding."""
        hq, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = cos.reshape(b * k, hd).contiguous(), sin.reshape(b * k, hd).contiguous()   # [B K, hd]
        taps: dict[int, torch.Tensor] = {}
        mlp_out = None
        for idx, w in enumerate(self._block_weights(half)):
            x, y = blocks.attn_in(x, mlp_out, w.in_norm, w.in_eps, w.wqkv, w.bqkv, half, w.qk_norm, w.qk_eps, cos, sin,
                                  hq, hkv, hd)
            if idx - 1 in self.tap_layers:
                taps[idx - 1] = x
            y = y.view(b, k, -1, hd).transpose(1, 2)                            # [B, Hq + 2 Hkv, K, hd]
            attend.write(idx, y[:, hq:hq + hkv], y[:, hq + hkv:])
            out = attend(idx, y[:, :hq])                                        # [B, Hq, K, hd]
            a = out.transpose(1, 2).reshape(b * k, -1).contiguous()
            x, mlp_out = blocks.attn_out_mlp(a, w.wo, w.bo, x, w.post_norm, w.post_eps, w.wgu, w.bgu, w.wdown,
                                             w.bdown, half)
        return x, mlp_out, taps

    @torch.no_grad()
    def logits(self, x: torch.Tensor,                 # [B, K, h] the last layer's output
               logits_for: str | torch.Tensor = "all",
               logits_into: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final norm and the LM head where ``logits_for`` asks (``run``'s): [B, K, V]
        float32 ([F, 1, V] for F token indices, [B, 1, V] for "last"; None for "none")."""
        b, k = x.shape[:2]
        if isinstance(logits_for, torch.Tensor):
            x = x.reshape(b * k, -1)[logits_for]
            b, k = logits_for.shape[0], 1
        elif logits_for == "none":
            return None
        elif logits_for == "last":
            x = x[:, -1]
            k = 1
        else:
            assert logits_for == "all", f"logits_for must be all, last or none, not {logits_for!r}"
            x = x.reshape(b * k, -1)
        if (w := self._native_head(x)) is not None:   # the norm and the head in one call
            norm = self.base.norm
            return blocks.norm_linear(x.contiguous(), norm.weight, norm.variance_epsilon, w, self.weights.head.bias,
                                      logits_into).view(b, k, -1)
        x = self._norm(self.base.norm, x)
        return self._head(x, logits_into).view(b, k, -1)

    def _native_head(self, x: torch.Tensor) -> torch.Tensor | None:
        """The LM head's weight as ``blocks.norm_linear`` takes it for the rows x [N, h],
        where the final norm is the native one and the plan runs N rows natively: the
        float32 weight (``NATIVE``) or its bfloat16 copy (``HALF``); None elsewhere."""
        n = x.shape[0]
        if self.ops is not NATIVE_OPS or self.products is None or x.dtype != torch.float32 or torch.is_grad_enabled():
            return None
        head, layout = self.weights.head, self.products.layout(n)
        w = head.weight if layout == NATIVE else head.half if layout == HALF else None
        if w is None or not native_can_run(w) or n > (most_rows(w) or n):
            return None
        return w

    def _head(self, x: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        """The LM head over x [N, h] -> [N, V] float32; into ``into`` (flat, float32, at
        least N * V elements) where given and the plan runs N rows as ``F.linear`` (the
        same product, ``x @ W^T``, into memory the caller keeps: a CPU step's logits are
        otherwise pages taken from the kernel anew, one fault at a time, every step)."""
        head, n = self.weights.head, x.shape[0]
        if (into is not None and self.products is not None and self.products.layout(n) == F_LINEAR
                and head.bias is None and x.dtype == into.dtype == torch.float32):
            return torch.mm(x, head.weight.t(), out=into[:n * self.vocab_size].view(n, self.vocab_size))
        return self._linear(x, head).float()

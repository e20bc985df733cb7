"""The DSpark drafter: a parallel block backbone plus a low-rank Markov head.

DSpark (semi-autoregressive drafting) runs ONE backbone forward over a block of
``block_size`` rows (row 0 = the anchor token, the others a mask token). The rows
attend, bidirectionally, to each other and to a *context*: the target's hidden
states from a few tapped layers at every committed position, concatenated, mixed
by ``fc`` and normalised. Row k yields base logits U_k for the token at offset k+1
after the anchor. The Markov head adds the dependency on the parent token:

    q(. | parent, offset k) = softmax(U_k + W2 . W1[parent])

so a tree expander can ask for the distribution under any parent for the cost of
a row lookup and a matrix-vector product.

The module's parameter names follow the public DSpark checkpoint layout
(``deepseek-ai/dspark_qwen3_4b_block7``: embed_tokens, fc, hidden_norm,
layers.N.self_attn.{q,k,v,o}_proj / q_norm / k_norm, layers.N.mlp, norms, norm,
lm_head, markov_head.markov_w1 / markov_w2), so that checkpoint loads strictly.
Two extensions keep small drafters cheap: shared embeddings (the embedding and the LM
head taken from the target, not stored: ``shared_embeddings``, ``shared_lm_head``) and
a reduced draft vocabulary (``draft_vocab_size``, as in EAGLE-3 / FR-Spec). Its map is
the ``d2t`` buffer, stored as EAGLE-3 and vLLM store it: *offsets*, so draft index i
is token ``i + d2t[i]`` (``draft_to_target`` gives the token ids).

Checkpoints (reading the public layout, writing ours) are ``treespark.models.checkpoint``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from treespark.kernels import blocks, native
from treespark.kernels.attention import ContextKV, attention_bias, grouped_attention
from treespark.kernels.layer_ops import native_rms_norm
from treespark.kernels.linear import Linear, on_native, unplanned_linear
from treespark.models.drafter_blocks import NativeBlockPass
from treespark.models.drafter_config import DSparkConfig
from treespark.models.rotary import Rotary, apply_rope


class RMSNorm(nn.Module):
    """transformers' RMSNorm maths (normalised in float32, cast back, then weighted) in one
    call: ``F.rms_norm`` (``treespark.kernels.layer_ops.rms_norm``: the same bits), or on the
    CPU without gradients ``blocks.c``'s row norm (``native_rms_norm``: its values to float
    rounding, one call where torch's CPU ``rms_norm`` is ~7 operators)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return native_rms_norm(x, self.weight, self.eps)


class DSparkAttention(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.c = c
        h, hd = c.hidden_size, c.head_dim
        self.q_proj = Linear(h, c.num_attention_heads * hd, bias=False)
        self.k_proj = Linear(h, c.num_key_value_heads * hd, bias=False)
        self.v_proj = Linear(h, c.num_key_value_heads * hd, bias=False)
        self.o_proj = Linear(c.num_attention_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of x [B, S, h] with the rotary cos/sin [B, S, hd] of its
        positions -> two [B, kvh, S, hd]."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.c.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,           # [B, S, h] the block rows
        cos: torch.Tensor,         # [B, S, hd] rotary cos/sin of the rows' positions
        sin: torch.Tensor,
        ctx_k: torch.Tensor,       # [B, kvh, C, hd] context keys (cached)
        ctx_v: torch.Tensor,       # [B, kvh, C, hd]
        mask: torch.Tensor,        # [B, 1, S, C + S] bool, True = may attend
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, self.c.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward_cached(
        self,
        x: torch.Tensor,           # [B, S] the block rows
        cos: torch.Tensor,         # [B, S, hd]
        sin: torch.Tensor,
        k: torch.Tensor,           # [B, kvh, C, hd] a copy of the context keys, room for the block
        v: torch.Tensor,           # [B, kvh, C, hd]
        positions: torch.Tensor,   # [B, S] the rows' positions (< C)
        bias: torch.Tensor,        # [B, 1, G*S, C] additive (attention_bias)
    ) -> torch.Tensor:
        """``forward`` over a context copy the block's keys and values are written into
        (at ``positions``), instead of concatenated onto it."""
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, s, -1, self.c.head_dim)).transpose(1, 2), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)                                   # [B, kvh, S, hd]
        at = positions[:, None, :, None].expand_as(k_blk)
        k.scatter_(2, at, k_blk.to(k.dtype))
        v.scatter_(2, at, v_blk.to(v.dtype))
        out = grouped_attention(q, k.to(q.dtype), v.to(q.dtype), bias)      # [B, H, S, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DSparkMLP(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkLayer(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(c)
        self.mlp = DSparkMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, k, v, positions, bias):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, k, v, positions, bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank transition bias B(parent, v) = <W1[parent], W2[v]>."""

    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Linear(c.markov_rank, c.vocab_size, bias=False)   # weight [V, r]
        # weight [Vd, r]; a ``Linear`` for its exact bfloat16 panels (``panels``), which the waves read
        self.markov_w2 = Linear(c.markov_rank, c.draft_vocab, bias=False)

    def bias(self, parents: torch.Tensor) -> torch.Tensor:
        """parents: [...] token ids -> [..., Vd]."""
        return self.markov_w1.weight[parents] @ self.markov_w2.weight.T


class ConfidenceHead(nn.Module):
    """DSpark's per-position acceptance estimate: a linear map of the hidden state (and of
    the parent's Markov embedding W1[parent] when ``confidence_head_with_markov``)."""

    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0), 1)


class DSparkDrafter(nn.Module):
    """The drafter. Serving calls ``context_kv`` (once per committed position) and
    ``block_logits`` (once per round for the whole batch, reading the cached context
    through a ``treespark.kernels.attention.ContextKV``); training calls
    ``train_logits``."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        c = self.config = config
        if not c.shared_embeddings:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if not c.head_shared:
            self.lm_head = Linear(c.hidden_size, c.draft_vocab, bias=False)
        self.fc = Linear(c.context_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov_head = MarkovHead(c)
        if c.confidence_head:
            self.confidence_head = ConfidenceHead(c)
        if c.draft_vocab_size:  # offsets: draft index i is token i + d2t[i] (zeros: the first Vd ids)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long), persistent=True)
        else:
            self.d2t = None
        self._shared_embed: torch.Tensor | None = None
        self._shared_head: torch.Tensor | None = None
        self._shared_head_half: torch.Tensor | None = None   # its bfloat16 panels, where they hold its values
        self.rotary = Rotary(c)
        self.native = NativeBlockPass(c)   # the block pass on the native blocks, where it runs

    # -- shared embeddings ------------------------------------------------------------
    def attach_target_embeddings(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Use the target's embedding [V, h] and LM head [V, h] (rows cut to the draft
        vocabulary) where this drafter shares them. They stay out of its state dict."""
        c = self.config
        if not (c.shared_embeddings or c.head_shared):
            raise ValueError("this drafter stores its own embeddings and LM head (nothing to share)")
        if c.shared_embeddings:
            self._shared_embed = embed.detach()
        if c.head_shared:
            head = lm_head.detach()
            d2t = self.draft_to_target
            self._shared_head = head[d2t.to(head.device)] if d2t is not None else head
            self._shared_head_half = native.exact_panels(self._shared_head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    @property
    def embed_weight(self) -> torch.Tensor:
        """The token embedding table [V, h]: the target's where shared, else its own."""
        if self.config.shared_embeddings:
            if self._shared_embed is None:
                raise RuntimeError("shared-embedding drafter used before attach_target_embeddings()")
            return self._shared_embed
        return self.embed_tokens.weight

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.config.head_shared:
            if self._shared_head is None:
                raise RuntimeError("shared-LM-head drafter used before attach_target_embeddings()")
            return unplanned_linear(h, self._shared_head, half=self._shared_head_half)
        return self.lm_head(h)

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[Vd] the token id of each draft index (``i + d2t[i]``); None: the identity."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_draft_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Make draft index i stand for ``token_ids[i]`` (stored as offsets in ``d2t``)."""
        if self.d2t is None or token_ids.shape != self.d2t.shape:
            raise ValueError(f"a draft vocabulary of {self.config.draft_vocab} ids is needed, got "
                             f"{tuple(token_ids.shape)}")
        with torch.no_grad():
            self.d2t.copy_(token_ids.to(self.d2t) - torch.arange(token_ids.numel(), device=self.d2t.device))

    # -- serving -------------------------------------------------------------------------
    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps: [..., n_taps * target_hidden] -> context hidden states [..., h]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def context_kv_train(self, taps: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """taps: [B, S, n_taps*th], positions: [B, S] -> keys, values [L, B, kvh, S, hd]
        for every drafter layer (what the drafter's KV cache stores per position)."""
        return self._layers_kv(self.context(taps), positions)

    def _layers_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(positions, ctx.dtype)
        ks, vs = zip(*(layer.self_attn.kv(ctx, cos, sin) for layer in self.layers), strict=True)
        return torch.stack(ks), torch.stack(vs)

    @torch.no_grad()
    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, store_k: torch.Tensor,
                      store_v: torch.Tensor, slots: torch.Tensor) -> None:
        """``context_kv`` of ``taps`` [N, n_taps * target_hidden] at ``positions`` [N]
        written at ``slots`` [N] of a paged store's keys and values [L, S, kvh, hd]: at a
        decoding step's few rows on the CPU one native call after ``fc``
        (``NativeBlockPass.write_context``), else ``context_kv`` and one write a store."""
        x = self.fc(taps.to(self.fc.weight.dtype))
        if self.native.write_context(self.layers, x, self.hidden_norm.weight, self.hidden_norm.eps, self.rotary,
                                     positions, store_k, store_v, slots):
            return
        k, v = self._kv_of(x[None], positions[None])                        # [L, 1, kvh, N, hd]
        store_k[:, slots] = k[:, 0].transpose(1, 2).to(store_k.dtype)
        store_v[:, slots] = v[:, 0].transpose(1, 2).to(store_v.dtype)

    @torch.no_grad()
    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``context_kv_train`` without gradients: what serving writes to the KV cache (at
        a decoding step's few rows on the CPU, one native call after ``fc``:
        ``NativeBlockPass.context_kv``)."""
        return self._kv_of(self.fc(taps.to(self.fc.weight.dtype)), positions)

    def _kv_of(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``context_kv`` from the rows after ``fc``, x [B, S, h]."""
        if not self.native.runs_context(self.layers, x):
            return self._layers_kv(self.hidden_norm(x), positions)
        cos, sin = self.rotary(positions, x.dtype)
        return self.native.context_kv(self.layers, x, self.hidden_norm.weight, self.hidden_norm.eps, cos, sin)

    def _block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        ids = torch.full((anchors.shape[0], self.config.block_size), self.config.mask_token_id,
                         dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        return ids

    def _backbone(self, ids, positions, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = self.embed(ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], mask)
        return self.head(self.norm(x))

    @torch.no_grad()
    def block_logits(
        self,
        anchors: torch.Tensor,     # [B] the root token of each row
        context: ContextKV,        # the rows' cached context keys and values, read a layer at a time
        ctx_len: torch.Tensor,     # [B] committed positions of each row
        depths: int | None = None,
    ) -> torch.Tensor:
        """Base logits U: [B, depths, Vd] (``depths`` None: block_size); row k is for depth
        k + 1: ``block_head`` of ``block_hidden``'s first ``depths`` positions. The block's
        every position is computed (each attends to the whole block); a step that drafts no
        deeper than ``depths`` runs the head over those rows only (its largest product)."""
        return self.block_head(self.block_hidden(anchors, context, ctx_len)[:, :depths])

    @torch.no_grad()
    def block_hidden(self, anchors: torch.Tensor, context: ContextKV, ctx_len: torch.Tensor) -> torch.Tensor:
        """The block's last hidden states [B, block_size, h] (``block_logits``' arguments).
        Each layer reads its context keys and values as one copy with room for the block,
        writes the block's own there (positions ``ctx_len ..``) and attends over it: no
        concatenation, and no copy of every layer at once. Nothing is read to the host and
        no shape depends on the values: what ``treespark.engine.draft_graphs`` captures."""
        positions = ctx_len[:, None] + torch.arange(self.config.block_size, device=anchors.device)   # [B, blk]
        ids = self._block_ids(anchors)
        if self.fc.weight.dtype == torch.float32 and self.native.runs(ids):
            return self.native(self.layers, ids, self.embed_weight, self.rotary, context, ctx_len, positions,
                               self._context_layer)
        x = self.embed(ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        bias = None
        for i, layer in enumerate(self.layers):
            k, v, bias = self._context_layer(context, i, ctx_len, bias, x.dtype)
            x = layer.forward_cached(x, cos, sin, k, v, positions, bias)
        return x

    def _context_layer(self, context: ContextKV, i: int, ctx_len: torch.Tensor, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s context keys and values, a copy with room for the block [B, kvh, C,
        hd] each, and the block's attention bias: ``bias`` once made, since every row sees
        its context and the whole block in every layer."""
        blk = self.config.block_size
        k, v = context.read(i, blk)
        if bias is None:
            seen = torch.arange(k.shape[2], device=k.device)[None] < (ctx_len + blk)[:, None]   # [B, C]
            groups = self.config.num_attention_heads // self.config.num_key_value_heads
            bias = attention_bias(seen[:, None, None].expand(k.shape[0], 1, blk, -1), groups, dtype, k.shape[2])
        return k, v, bias

    @torch.no_grad()
    def block_head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., h] -> base logits [..., Vd] in float32 (the final norm and
        the LM head: one native call where ``head`` would run natively, ``blocks.norm_linear``)."""
        rows = x.reshape(-1, x.shape[-1])
        if (self.config.head_shared and self._shared_head is not None and on_native(rows, self._shared_head)
                and self.norm.weight.dtype == torch.float32):
            w = self._shared_head if self._shared_head_half is None else self._shared_head_half
            out = blocks.norm_linear(rows.contiguous(), self.norm.weight, self.norm.eps, w, None)
            return out.view(*x.shape[:-1], -1)
        return self.head(self.norm(x)).float()

    @torch.no_grad()
    def block_logits_dense(
        self,
        anchors: torch.Tensor,     # [B]
        ctx_k: torch.Tensor,       # [L, B, kvh, C, hd] every layer's context keys
        ctx_v: torch.Tensor,       # [L, B, kvh, C, hd]
        ctx_len: torch.Tensor,     # [B] (<= C)
    ) -> torch.Tensor:
        """``block_logits`` on the training path (the block's keys and values concatenated
        onto the dense context in every layer): the reference it is tested against."""
        b, blk = anchors.shape[0], self.config.block_size
        c = ctx_k.shape[3]
        dev = anchors.device
        positions = ctx_len[:, None] + torch.arange(blk, device=dev)          # [B, blk]
        ctx_mask = torch.arange(c, device=dev)[None, :] < ctx_len[:, None]   # [B, C]
        mask = torch.cat([ctx_mask[:, None, :].expand(b, blk, c),
                          torch.ones(b, blk, blk, dtype=torch.bool, device=dev)], dim=2)
        return self._backbone(self._block_ids(anchors), positions, ctx_k, ctx_v, mask[:, None]).float()

    # -- training ------------------------------------------------------------------------
    def train_logits(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits for many blocks of one sequence at once.

        taps: [S, n_taps*th] the target's tapped hidden states; tokens: [S];
        anchors: [nb] anchor positions (context = positions < anchor).
        Returns [nb, block_size, Vd]: row k of block i predicts the token after
        position anchors[i] + k, with the Markov parent tokens[anchors[i] + k].
        """
        s, blk, nb = tokens.shape[0], self.config.block_size, anchors.shape[0]
        dev = tokens.device
        assert int(anchors.max()) + blk <= s, "every block must lie inside the sequence"
        pos_ctx = torch.arange(s, device=dev)[None]
        ctx_k, ctx_v = self.context_kv_train(taps[None], pos_ctx)             # [L, 1, kvh, S, hd]
        ctx_k = ctx_k.expand(-1, nb, -1, -1, -1)
        ctx_v = ctx_v.expand(-1, nb, -1, -1, -1)
        positions = anchors[:, None] + torch.arange(blk, device=dev)          # [nb, blk]
        ctx_mask = pos_ctx < anchors[:, None]                                 # [nb, S]
        mask = torch.cat([ctx_mask[:, None, :].expand(nb, blk, s),
                          torch.ones(nb, blk, blk, dtype=torch.bool, device=dev)], dim=2)
        u = self._backbone(self._block_ids(tokens[anchors]), positions, ctx_k, ctx_v, mask[:, None])
        parents = tokens[positions]                                           # [nb, blk]
        return u + self.markov_head.bias(parents)


def grown(drafter: DSparkDrafter, num_layers: int) -> DSparkDrafter:
    """``drafter`` with layers appended up to ``num_layers``: each new one a copy of the
    last with its output projections (attention ``o_proj``, MLP ``down_proj``) zeroed, so
    its residual branch adds nothing. The grown drafter drafts what ``drafter`` drafts
    until training moves the new layers."""
    have = drafter.config.num_hidden_layers
    if num_layers < have:
        raise ValueError(f"cannot grow a {have}-layer drafter to {num_layers} layers")
    out = DSparkDrafter(replace(drafter.config, num_hidden_layers=num_layers)).to(drafter.fc.weight.dtype)
    state = drafter.state_dict()
    last = f"layers.{have - 1}."
    top = {k[len(last):]: v for k, v in state.items() if k.startswith(last)}
    for i in range(have, num_layers):
        for k, v in top.items():
            zero = k.endswith(("o_proj.weight", "down_proj.weight"))
            state[f"layers.{i}.{k}"] = torch.zeros_like(v) if zero else v.clone()
    out.load_state_dict(state, strict=True)   # d2t is copied into the module's own int64 buffer
    # the target's tensors where shared (the head already cut to the draft vocabulary)
    out._shared_embed, out._shared_head = drafter._shared_embed, drafter._shared_head
    out._shared_head_half = drafter._shared_head_half
    return out.train(drafter.training)


def attach_from_target(drafter: DSparkDrafter, target: torch.nn.Module) -> None:
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    dtype = drafter.fc.weight.dtype
    drafter.attach_target_embeddings(embed.to(dtype), head.to(dtype))

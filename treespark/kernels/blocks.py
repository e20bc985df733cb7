"""A decoder layer's few-row forward in two native calls around its attention (``blocks.c``).

At the rows of a CPU decoding step (one to ``MAX_ROWS``) a layer's products stream its
weights in ~0.4 ms, and the ~50 torch operators between them (norms, residual adds,
rotary embeddings, the activation, the products' reshapes) cost as much again in
dispatch. ``attn_in`` runs everything before the attention (the residual add, the input
norm, q|k|v, Qwen3's q/k norms, the rotary embedding) and ``attn_out_mlp`` everything
after it (o, the residual add, the post-attention norm, gate|up, the activation, down),
each in one call. Between them ``paged_attention`` attends the few query tokens over a
paged store's blocks in place, where the torch path gathers the blocks into a copy and
calls SDPA (whose fixed cost, ~0.1 ms a call, is most of a decoding step's attention);
the masks and the store stay ``treespark.engine.attend``'s. The products are ``native_linear``'s kernel on
the float32 weights or their bfloat16 copies (``half``): for a plan that runs these rows
``NATIVE`` or ``HALF`` the values are the torch forward's to float rounding
(``tests/kernels/test_blocks.py``).

``layers`` runs a few-row forward's whole layer stack over a paged store in one call
(``ts_layers``: the same three functions per layer, and the keys' and values' writes at
their slots; a decoding step's trees, a prefill's packed chunks through ``chunks.c``'s
attention, or both; the embeddings and the rotation looked up in it, the last layer's
residual add and the taps written by it): what's left of a step's Python per layer,
~0.1 ms (the views, the writes' indexing, the calls' arguments), is paid once a forward.
``norm_linear`` is a forward's final norm and LM head in one call, ``context_write`` the
drafter's context keys and values of a commit's rows made and written in one.

``add_norm``, ``qk_rope`` and ``silu_rows`` are ``attn_in``'s and ``attn_out_mlp``'s
non-product parts alone, over any rows: a prefill's hundreds of rows, whose products
oneDNN runs (``treespark.kernels.layer_ops.NATIVE_OPS``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from treespark.kernels.chunks import PackedChunks
from treespark.kernels.native import MAX_ROWS, as_long, library, most_rows, operator, pointer

# what torch.profiler calls them
PROFILER_NAMES = ("treespark::attn_in", "treespark::attn_out_mlp", "treespark::paged_attention",
                  "treespark::layers", "treespark::add_norm", "treespark::qk_rope", "treespark::silu_rows",
                  "treespark::context_write", "treespark::norm_linear")
ACTIVATIONS = ("silu", "swish")  # the hidden_act names blocks.c computes
# paged_attention cuts each row's keys into spans of this many blocks, from the first (work
# for every thread; the same spans whatever the batch, so a row's values do not depend on it)
SPAN_BLOCKS = 8


def qk_norm_weight(q_norm: torch.Tensor, k_norm: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Qwen3's q and k norm weights [hd] each as the one per-head weight [Hq + Hkv, hd]
    ``attn_in`` takes."""
    return torch.cat([q_norm.detach().expand(heads, -1), k_norm.detach().expand(kv_heads, -1)]).contiguous()


# the most decoding rows (tree tokens) the blocks take where every product is AMX tiles
# (``native.most_rows``: their cost flat in the rows), so a batch of trees runs natively too;
# a wider batch of trees goes to the per-layer path, whose SDPA is faster there than
# ``paged_attention``. A packed prefill's tokens beside them count for nothing: the
# products take any rows on tiles and ``chunk_attention`` any chunks (a 256-token prompt
# chunk in one call ran its prefill step in ~0.88 of the per-layer path's time, the
# Python between the operators gone)
TILE_ROWS = 64


def max_rows(tiles: bool) -> int:
    """The most rows the blocks take: ``TILE_ROWS`` where the weights are ``tiles``, else
    ``MAX_ROWS``."""
    return TILE_ROWS if tiles else MAX_ROWS


def can_run(rows: int, hidden_act: str, tiles: bool = False, chunk_rows: int = 0) -> bool:
    """Whether the blocks take a forward of ``rows`` rows with this activation (and the
    library is built), ``chunk_rows`` of them a packed prefill's: up to ``max_rows(tiles)``,
    the prefill's not counted where the weights are ``tiles``."""
    bounded = rows - chunk_rows if tiles else rows
    return 1 <= rows and bounded <= max_rows(tiles) and hidden_act in ACTIVATIONS and library() is not None


def all_tiles(weights: list[LayerWeights]) -> bool:
    """Whether every product weight of these layers is bfloat16 panels in tile form."""
    return all(w.dtype == torch.bfloat16 and most_rows(w) is None
               for lw in weights for w in (lw.wqkv, lw.wo, lw.wgu, lw.wdown))


def attn_in(x: torch.Tensor,              # [M, D] the residual stream
            d: torch.Tensor | None,       # [M, D] added to it first (the last layer's MLP output), or None
            norm_w: torch.Tensor, eps: float,   # the input norm's [D]
            w: torch.Tensor, b: torch.Tensor | None, half: bool,  # q|k|v [(Hq + 2 Hkv) hd, D] (+ bias)
            qk_norm: torch.Tensor | None, qk_eps: float,          # [Hq + Hkv, hd] per-head weight, or None
            cos: torch.Tensor, ssin: torch.Tensor,               # [M, hd] (ssin: rope_sign applied)
            heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, q|k|v [M, (Hq + 2 Hkv) hd] with q and k normed and rotated); x itself where
    ``d`` is None."""
    m, dim = x.shape
    n = (heads + 2 * kv_heads) * head_dim
    x_out = torch.empty_like(x) if d is not None else x
    normed, qkv = torch.empty_like(x), torch.empty(m, n, dtype=torch.float32)
    with operator(PROFILER_NAMES[0]):
        rc = library().ts_attn_in(x.data_ptr(), pointer(d), norm_w.data_ptr(), eps, w.data_ptr(), pointer(b), int(half),
                                  pointer(qk_norm), qk_eps, cos.data_ptr(), ssin.data_ptr(), x_out.data_ptr(),
                                  normed.data_ptr(), qkv.data_ptr(), m, dim, heads, kv_heads, head_dim,
                                  torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_attn_in refused rows {m}, hidden {dim}, heads {heads}/{kv_heads}, head_dim {head_dim}")
    return x_out, qkv


def add_norm(x: torch.Tensor, d: torch.Tensor | None, norm_w: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, its RMSNorm times ``norm_w``) over rows x, d [M, D] (float32, contiguous); x
    itself and its norm where ``d`` is None: ``attn_in``'s first part, for rows whose
    products run elsewhere."""
    m, dim = x.shape
    x_out = torch.empty_like(x) if d is not None else x
    normed = torch.empty_like(x)
    with operator(PROFILER_NAMES[4]):
        rc = library().ts_add_norm(x.data_ptr(), pointer(d), norm_w.data_ptr(), eps, x_out.data_ptr(),
                                   normed.data_ptr(), m, dim, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_add_norm refused rows {m}, hidden {dim}")
    return x_out, normed


def qk_rope(qkv: torch.Tensor,                        # [M, (Hq + 2 Hkv) hd], changed in place
            qk_norm: torch.Tensor | None, qk_eps: float,  # [Hq + Hkv, hd] per-head weight, or None
            cos: torch.Tensor, ssin: torch.Tensor,    # [M, hd] (ssin: rope_sign applied)
            heads: int, kv_heads: int, head_dim: int) -> None:
    """``attn_in``'s last part: each row's q and k heads normed (Qwen3) and rotated, in place."""
    with operator(PROFILER_NAMES[5]):
        rc = library().ts_qk_rope(qkv.data_ptr(), pointer(qk_norm), qk_eps, cos.data_ptr(), ssin.data_ptr(),
                                  qkv.shape[0], heads, kv_heads, head_dim, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_qk_rope refused rows {qkv.shape[0]}, heads {heads}/{kv_heads}, head_dim {head_dim}")


def silu_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2 I] (gate, then up, a row) -> silu(gate) up [M, I]: ``attn_out_mlp``'s activation."""
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    act = torch.empty(m, inter, dtype=torch.float32)
    with operator(PROFILER_NAMES[6]):
        rc = library().ts_silu_rows(gate_up.data_ptr(), act.data_ptr(), m, inter, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_silu_rows refused rows {m}, width {gate_up.shape[1]}")
    return act


def attn_out_mlp(a: torch.Tensor,                      # [M, A] the attention's output, heads flattened
                 wo: torch.Tensor, bo: torch.Tensor | None,   # [D, A] (+ bias)
                 x: torch.Tensor,                      # [M, D] the residual stream
                 norm_w: torch.Tensor, eps: float,     # the post-attention norm's [D]
                 wgu: torch.Tensor, bgu: torch.Tensor | None,  # gate|up [2 I, D] (+ bias)
                 wdown: torch.Tensor, bdown: torch.Tensor | None,  # [D, I] (+ bias)
                 half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a Wo^T, the MLP's output [M, D] on that stream's norm)."""
    m, dim = x.shape
    inter = wdown.shape[1]
    x_out, normed, mlp = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    gu, act = torch.empty(m, 2 * inter, dtype=torch.float32), torch.empty(m, inter, dtype=torch.float32)
    with operator(PROFILER_NAMES[1]):
        rc = library().ts_attn_out_mlp(a.data_ptr(), wo.data_ptr(), pointer(bo), x.data_ptr(), norm_w.data_ptr(), eps,
                                       wgu.data_ptr(), pointer(bgu), wdown.data_ptr(), pointer(bdown), int(half),
                                       x_out.data_ptr(), normed.data_ptr(), gu.data_ptr(), act.data_ptr(),
                                       mlp.data_ptr(), m, dim, a.shape[1], inter, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_attn_out_mlp refused rows {m}, hidden {dim}, attention {a.shape[1]}, mlp {inter}")
    return x_out, mlp


def norm_linear(x: torch.Tensor,                       # [M, D] float32, contiguous
                norm_w: torch.Tensor, eps: float,      # the norm's [D]
                w: torch.Tensor, b: torch.Tensor | None,   # [N, D] float32, or its bfloat16 panels
                out: torch.Tensor | None = None,       # flat float32 room for [M, N], or None
                ) -> torch.Tensor:
    """(x's RMSNorm times ``norm_w``) W^T (+ b) [M, N] in one call (``ts_norm_linear``: a
    forward's final norm and LM head): ``add_norm``'s norm, then ``native_linear``'s
    product, the same floats; into ``out`` where given. For the rows ``native_linear``
    takes of ``w`` (``most_rows``)."""
    m, dim = x.shape
    n = w.shape[0]
    assert x.dtype == torch.float32 and x.is_contiguous() and 1 <= m <= (most_rows(w) or m), (tuple(x.shape), m)
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out[:m * n].view(m, n)
    with operator(PROFILER_NAMES[8]):
        rc = library().ts_norm_linear(x.data_ptr(), norm_w.data_ptr(), eps, w.data_ptr(), pointer(b),
                                      int(w.dtype == torch.bfloat16), y.data_ptr(), m, dim, n, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_norm_linear refused rows {m}, hidden {dim}, out {n} (rc {rc})")
    return y


def context_write(x: torch.Tensor,             # [M, D] the rows, before their norm
                  norm_w: torch.Tensor, eps: float,   # the norm's [D]
                  w: torch.Tensor, half: bool,      # every layer's k, then every layer's v [2 L Hkv hd, D]
                  k_norm: torch.Tensor | None, k_eps: float,   # [L Hkv, hd] per-head weight, or None
                  cos_tab: torch.Tensor, ssin_tab: torch.Tensor,   # [P, hd] (ssin_tab: rope_sign applied)
                  positions: torch.Tensor,          # [M] int64, each row's position (< P)
                  slots: torch.Tensor,              # [M] int64, where its keys and values go
                  keys: torch.Tensor, values: torch.Tensor,   # the paged store's [L, S, Hkv, hd]
                  ) -> bool:
    """A drafter's context rows written into its paged store in one call
    (``ts_context_write``): ``attn_in`` with no query heads over the stacked k and v
    products, the rotation read from the tables at ``positions``, then each layer's keys
    and values at ``slots``. False (nothing written) where a position is past the tables."""
    m, dim = x.shape
    n_layers, s, hkv, hd = keys.shape
    assert keys.is_contiguous() and values.is_contiguous() and keys.dtype == values.dtype == torch.float32
    with operator(PROFILER_NAMES[7]):
        rc = library().ts_context_write(x.data_ptr(), norm_w.data_ptr(), eps, w.data_ptr(), int(half), pointer(k_norm),
                                        k_eps, cos_tab.data_ptr(), ssin_tab.data_ptr(), cos_tab.shape[0],
                                        positions.data_ptr(), slots.data_ptr(), keys.data_ptr(), values.data_ptr(), s,
                                        m, dim, n_layers, hkv, hd, torch.get_num_threads())
    if rc not in (0, -3):
        raise ValueError(f"ts_context_write refused rows {m}, hidden {dim}, {n_layers} layers of {hkv} x {hd} (rc {rc})")
    return rc == 0


def can_attend(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether ``paged_attention`` takes these queries [B, H, K, hd] over this cache
    [slots, kvh, hd]: float32 on the CPU, at most ``MAX_ROWS`` query tokens (B K), the
    library built. More tokens (a prefill chunk, a wide batch of trees) go to SDPA's
    blocked kernel, which is faster there."""
    return (q.device.type == "cpu" and q.dtype == cache.dtype == torch.float32
            and q.shape[0] * q.shape[2] <= MAX_ROWS and library() is not None)


def mask_bytes(mask: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """A boolean mask [B, 1, K, T] (True = may attend) as the bytes [B, K, T] the native
    attention reads: a view where it is contiguous (no operator called)."""
    assert mask.dtype == torch.bool and mask.shape[:3] == (b, 1, k), (tuple(mask.shape), b, k)
    return (mask if mask.is_contiguous() else mask.contiguous()).view(torch.uint8)


def paged_attention(q: torch.Tensor,       # [B, H, K, hd]
                    kc: torch.Tensor,      # [slots, kvh, hd] one layer's keys of a paged store
                    vc: torch.Tensor,      # [slots, kvh, hd] and values
                    table: torch.Tensor,   # [B, nb] the blocks each row reads
                    block_size: int,
                    mask: torch.Tensor,    # [B, 1, K, T] bool, True = may attend (T <= nb block_size)
                    scale: float | None = None) -> torch.Tensor:
    """``grouped_attention`` of the keys and values ``table`` names, read in place (no
    gathered copy, no SDPA call) under the boolean mask itself (no additive bias made):
    [B, H, K, hd], its values to float rounding."""
    b, h, k, hd = q.shape
    kvh, nb = kc.shape[1], table.shape[1]
    t = mask.shape[-1]
    assert t <= nb * block_size, (tuple(mask.shape), nb, block_size)
    assert kc.is_contiguous() and vc.is_contiguous()
    m = mask_bytes(mask, b, k)
    q = q.contiguous()
    table = as_long(table)
    splits = -(-nb // SPAN_BLOCKS)
    rows = (h // kvh) * k
    scratch = torch.empty(b * kvh * splits * rows * (SPAN_BLOCKS * block_size + hd + 2), dtype=torch.float32)
    out = torch.empty(b, h, k, hd, dtype=torch.float32)
    with operator(PROFILER_NAMES[2]):
        rc = library().ts_paged_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), table.data_ptr(), nb,
                                          block_size, m.data_ptr(), t, hd ** -0.5 if scale is None else scale,
                                          scratch.data_ptr(), out.data_ptr(), b, h, kvh, k, hd, SPAN_BLOCKS,
                                          torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"ts_paged_attention refused queries {tuple(q.shape)} over {kvh} KV heads, {nb} blocks")
    return out


@dataclass(frozen=True)
class PackedRows:
    """A prefill's packed chunk tokens as ``layers`` attends them: ``slots`` [N] where each
    token's keys and values go, ``packed`` its chunks (``chunk_attention``'s) and their
    attention's ``scale``."""

    slots: torch.Tensor
    packed: PackedChunks
    scale: float


class _Layer(ctypes.Structure):
    """``blocks.c``'s ``ts_layer``: one layer's weights and KV store, as pointers."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "in_norm", "wqkv", "bqkv", "qk_norm", "wo", "bo", "post_norm", "wgu", "bgu", "wdown", "bdown", "kc", "vc")
    ] + [(name, ctypes.c_float) for name in ("in_eps", "qk_eps", "post_eps")]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as ``attn_in`` and ``attn_out_mlp`` take it (the products float32
    weights, or bfloat16 panels for ``half``)."""

    in_norm: torch.Tensor
    in_eps: float
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    qk_norm: torch.Tensor | None
    qk_eps: float
    wo: torch.Tensor
    bo: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wdown: torch.Tensor
    bdown: torch.Tensor | None


class LayerStack:
    """A model's layers and its paged store as the one array of pointers ``layers`` hands
    to ``ts_layers``, and the layers whose outputs come back (``taps``, side by side in
    this order): made once (per store and weight copy) and kept, with the tensors it
    points into (so none is freed under it)."""

    def __init__(self, weights: list[LayerWeights], keys: torch.Tensor, values: torch.Tensor, half: bool,
                 heads: int, kv_heads: int, head_dim: int, taps: tuple[int, ...]) -> None:
        """``keys``, ``values``: the paged store's [layers, slots, kvh, hd] float32."""
        self.weights, self.keys, self.values, self.half = tuple(weights), keys, values, half
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        first = weights[0]
        self.hidden, self.inter = first.in_norm.numel(), first.wdown.shape[1]
        assert keys.dtype == values.dtype == torch.float32 and keys.is_contiguous() and values.is_contiguous()
        assert keys.shape[0] == len(weights) and keys.shape[2:] == (kv_heads, head_dim), (tuple(keys.shape), kv_heads)
        assert all(0 <= i < len(weights) for i in taps), taps
        self.taps = taps
        self.tiles = half and all_tiles(list(weights))   # the rows it takes: ``can_run``
        self.tapped = torch.arange(len(weights))[list(taps)]   # (int64)
        self.array = (_Layer * len(weights))(*(_Layer(
            *(pointer(getattr(w, f)) for f in ("in_norm", "wqkv", "bqkv", "qk_norm", "wo", "bo", "post_norm", "wgu",
                                            "bgu", "wdown", "bdown")), pointer(keys[i]), pointer(values[i]),
            w.in_eps, w.qk_eps, w.post_eps) for i, w in enumerate(weights)))


def layers(stack: LayerStack,
           tokens: torch.Tensor,         # [M] the trees' B K tokens (each row's K together), then the chunks' N
           embed: torch.Tensor,          # [V, D] float32, contiguous: the embedding table tokens index
           cos: torch.Tensor, ssin: torch.Tensor,   # the rotary tables [P, hd] (ssin: rope_sign applied)
           positions: torch.Tensor,      # [M] each token's position in the tables
           slots: torch.Tensor | None,   # [B, K] each tree token's slot in the paged store (None: no
                                         # trees, or with ``lens`` each at its position)
           table: torch.Tensor | None,   # [B, nb] the blocks each row reads
           block_size: int,
           mask: torch.Tensor | None,    # [B, 1, K, T] bool, True = may attend (``paged_attention``'s)
           scale: float,
           chunks: PackedRows | None = None,   # the N packed prefill tokens after the trees'
           *,
           lens: torch.Tensor | None = None,   # [B] a drafter block's rows (no ``slots``, ``mask`` or
                                               # chunks): every token of row b written at its
                                               # position, seeing the keys below lens[b]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A few-row forward's every layer in one call (``ts_layers``): the embeddings
    (``tokens``' rows) and each token's rotation (``positions``' rows of the tables) looked
    up, then per layer ``attn_in``, the new keys and values written at their slots, the
    attention (``paged_attention`` of the trees, ``chunk_attention`` of the chunks) and
    ``attn_out_mlp``, on the same functions in the same order, so the same floats as those
    calls made one by one. Returns the last layer's output [M, D] (its residual stream plus
    its MLP's output) and ``stack.taps``' outputs side by side [M, n D]. ValueError for a
    position past the tables."""
    assert embed.dtype == torch.float32 and embed.is_contiguous() and embed.shape[1] == stack.hidden
    tokens, positions = as_long(tokens), as_long(positions)
    x = torch.empty(tokens.shape[0], stack.hidden, dtype=torch.float32)
    m, dim = x.shape
    if lens is not None:
        assert slots is None and mask is None and chunks is None and table is not None
        b, k = lens.shape[0], m // lens.shape[0]
        lens = as_long(lens)
    else:
        b, k = (0, 0) if slots is None else slots.shape
    n = 0 if chunks is None else chunks.slots.shape[0]
    count = len(stack.weights)
    assert m == b * k + n and 1 <= m and (b * k if stack.tiles else m) <= max_rows(stack.tiles), (m, b, k, n)
    hq, hkv, hd = stack.heads, stack.kv_heads, stack.head_dim
    if lens is not None:
        mb, mt, table = None, 0, as_long(table)
    elif b * k:
        assert table is not None and mask is not None
        assert mask.shape[-1] <= table.shape[1] * block_size, (tuple(mask.shape), tuple(table.shape), block_size)
        mb, mt = mask_bytes(mask, b, k), mask.shape[-1]
        slots, table = as_long(slots), as_long(table)
        if chunks is not None:
            slots = torch.cat([slots.flatten(), as_long(chunks.slots)])
    else:
        mb, mt, table = None, 0, None
        slots = None if chunks is None else as_long(chunks.slots)
    c_tables = c_spans = None
    if chunks is not None:
        assert chunks.packed.block_size == block_size, (chunks.packed.block_size, block_size)
        c_tables, c_spans = chunks.packed.tables, chunks.packed.spans
    taps = torch.empty(m, len(stack.taps) * dim, dtype=torch.float32)
    with operator(PROFILER_NAMES[3]):
        rc = library().ts_layers(ctypes.cast(stack.array, ctypes.c_void_p), count, int(stack.half), x.data_ptr(),
                                 tokens.data_ptr(), embed.data_ptr(), embed.shape[0], taps.data_ptr(),
                                 len(stack.taps), stack.tapped.data_ptr(), cos.data_ptr(), ssin.data_ptr(),
                                 positions.data_ptr(), cos.shape[0], pointer(slots), pointer(table),
                                 0 if table is None else table.shape[1], block_size, pointer(mb), pointer(lens), mt,
                                 scale, b, k, n, pointer(c_tables),
                                 0 if c_tables is None else c_tables.shape[1], pointer(c_spans),
                                 0 if c_spans is None else c_spans.shape[0], 0.0 if chunks is None else chunks.scale,
                                 dim, hq, hkv, hd, stack.inter, SPAN_BLOCKS, torch.get_num_threads())
    if rc == -3:
        raise ValueError(f"ts_layers: a position past the rotary tables' {cos.shape[0]}")
    if rc != 0:
        raise ValueError(f"ts_layers refused {b} rows of {k} tokens and {n} chunk tokens (rc {rc})")
    return x, taps

"""treespark.kernels.blocks: a few-row forward's layers in two native calls around the
attention give the fused torch forward's logits (Llama; Qwen3 with q/k norms at the full
vocabulary; Qwen2 with q/k/v biases), on float32 weights and on bfloat16 copies; they run
exactly where the plan puts the rows on gemv.c; the few-row attention over a paged store
read in place gives the gathered SDPA's values; and the profiler sees them as operators."""

import numpy as np
import pytest
import torch

from tests.engine.test_fused_forward import _logits, _target
from tests.kernels.test_native import targets
from treespark.engine import target
from treespark.engine.kv import PagedRows, PagedStore
from treespark.engine.target import TargetRunner
from treespark.kernels import blocks
from treespark.kernels.attention import attention_bias, gather_blocks, grouped_attention
from treespark.kernels.linear import F_LINEAR, HALF, NATIVE, ProductPlan
from treespark.kernels.native import MAX_ROWS, library
from treespark.models.precision import round_to_bf16

needs_native = pytest.mark.skipif(library() is None, reason="no C compiler built treespark/kernels/")


def _counting(monkeypatch) -> list[int]:
    """How many times attn_in and attn_out_mlp run, counted through the module."""
    calls = [0, 0]
    for i, name in enumerate(("attn_in", "attn_out_mlp")):
        fn = getattr(blocks, name)

        def counted(*args, _fn=fn, _i=i, **kwargs):
            calls[_i] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(blocks, name, counted)
    return calls


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("layout", [NATIVE, HALF])
def test_the_blocks_give_the_fused_forwards_logits(family, layout, monkeypatch):
    model = _target(family)
    if layout == HALF:
        round_to_bf16(model)
    plan = ProductPlan((MAX_ROWS, MAX_ROWS + 1), (layout, F_LINEAR))
    on_blocks, eager = TargetRunner(model, (0, 1), plan), TargetRunner(model, (0, 1), plan)
    eager._blocks = False
    calls = _counting(monkeypatch)
    seq = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    layers = model.config.num_hidden_layers
    for k in (1, 3, MAX_ROWS):
        before = list(calls)
        got = _logits(on_blocks, seq, k)
        assert calls[0] - before[0] == calls[1] - before[1] == layers, "the k-token forward on the blocks"
        before = list(calls)
        want = _logits(eager, seq, k)
        assert calls == before, "the eager forward calls no block"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        ref = model(seq).logits[0, -3:]
    torch.testing.assert_close(_logits(on_blocks, seq, 3), ref, rtol=1e-4, atol=1e-4)   # the model's own


@needs_native
def test_rows_past_the_kernels_run_the_torch_forward(monkeypatch):
    """Rows the plan does not run on gemv.c (more than MAX_ROWS, or another layout) take
    the torch operators: the prefix forward of ``_logits`` (22 tokens) calls no block."""
    model = _target("llama")
    calls = _counting(monkeypatch)
    seq = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(6))
    _logits(TargetRunner(model, (0,), ProductPlan.fixed(F_LINEAR)), seq, 2)
    assert calls == [0, 0]
    _logits(TargetRunner(model, (0,), ProductPlan((MAX_ROWS, MAX_ROWS + 1), (NATIVE, F_LINEAR))), seq, 8)
    layers = model.config.num_hidden_layers
    assert calls == [layers, layers], "the 22-token prefix on torch's operators, the 8 tokens on the blocks"


@needs_native
def test_the_blocks_refuse_a_head_they_cannot_rotate():
    x = torch.randn(1, 8)
    w = torch.randn(3 * 3, 8)
    with pytest.raises(ValueError, match="ts_attn_in refused"):
        blocks.attn_in(x, None, torch.ones(8), 1e-6, w, None, False, None, 0.0, torch.ones(1, 3), torch.ones(1, 3),
                       1, 1, 3)


@needs_native
def test_the_profiler_sees_the_blocks_as_operators():
    """Host-share figures count operator time from the profiler (as for native_linear)."""
    from torch.profiler import profile

    model = _target("llama")
    runner = TargetRunner(model, (0,), ProductPlan.fixed(NATIVE))
    seq = torch.randint(0, 512, (1, 4), generator=torch.Generator().manual_seed(7))
    with profile() as prof:
        _logits(runner, seq, 1)
    ev = {e.key: e for e in prof.key_averages()}
    for name in blocks.PROFILER_NAMES[:2]:   # a dense store: no paged_attention
        assert name in ev and ev[name].count == model.config.num_hidden_layers * 2   # the prefix's 3 tokens, then 1
        assert ev[name].self_cpu_time_total > 0


@needs_native
@pytest.mark.parametrize("b,k,heads,kv_heads", [(1, 1, 9, 3), (2, 3, 4, 2), (8, 1, 4, 4), (1, 8, 6, 1)])
def test_paged_attention_reads_the_blocks_in_place_as_the_gathered_sdpa_does(b, k, heads, kv_heads):
    """Over shuffled blocks, a tree-like mask (each query its own allowed keys; the mask
    narrower than the blocks, whose keys past it are masked): grouped_attention's values
    over the gathered copy, under the bias that mask makes."""
    g = torch.Generator().manual_seed(b * 100 + k)
    bs, nb, hd, t = 4, 5, 16, 18
    slots = 64
    kc, vc = torch.randn(slots, kv_heads, hd, generator=g), torch.randn(slots, kv_heads, hd, generator=g)
    table = torch.stack([torch.randperm(slots // bs, generator=g)[:nb] for _ in range(b)])
    mask = torch.rand(b, 1, k, t, generator=g) < 0.7
    mask[..., 0] = True                                        # every query sees a key
    bias = attention_bias(mask, heads // kv_heads, torch.float32, nb * bs)
    q = torch.randn(b, heads, k, hd, generator=g)
    assert blocks.can_attend(q, kc)
    want = grouped_attention(q, gather_blocks(kc, table, bs), gather_blocks(vc, table, bs), bias, 0.3)
    torch.testing.assert_close(blocks.paged_attention(q, kc, vc, table, bs, mask, 0.3), want, rtol=1e-5, atol=1e-5)


@needs_native
def test_paged_attention_leaves_wide_forwards_to_sdpa():
    kc = torch.zeros(16, 2, 8)
    assert not blocks.can_attend(torch.zeros(1, 4, MAX_ROWS + 1, 8), kc)     # a prefill chunk
    assert not blocks.can_attend(torch.zeros(3, 4, 6, 8), kc)                # 18 query tokens
    assert not blocks.can_attend(torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16), kc.bfloat16())


@needs_native
def test_a_rows_paged_attention_does_not_depend_on_the_batch():
    """The spans fall at the same keys whatever the batch's width: a short row attended
    beside a long one gets the very floats it gets alone."""
    g = torch.Generator().manual_seed(11)
    bs, hd, heads, kv_heads = 4, 16, 4, 2
    long_blocks = 3 * blocks.SPAN_BLOCKS + 1
    kc, vc = torch.randn(512, kv_heads, hd, generator=g), torch.randn(512, kv_heads, hd, generator=g)
    table = torch.randperm(512 // bs, generator=g)[:2 * long_blocks].view(2, long_blocks)
    width = long_blocks * bs
    mask = torch.zeros(2, 1, 1, width, dtype=torch.bool)
    mask[0, ..., :10] = True                                   # a short row ...
    mask[1, ..., :width - 3] = True                            # ... beside a long one
    q = torch.randn(2, heads, 1, hd, generator=g)
    both = blocks.paged_attention(q, kc, vc, table, bs, mask)
    alone = blocks.paged_attention(q[:1], kc, vc, table[:1, :3], bs, mask[:1, ..., :3 * bs])
    assert torch.equal(both[:1], alone)


@needs_native
@pytest.mark.parametrize("hd,bs", [(64, 16), (16, 4), (12, 4)])
def test_a_query_tokens_attention_does_not_depend_on_the_tokens_beside_it(hd, bs):
    """A tree's K query tokens attended together get, each, the very floats it gets alone
    (K = 1, its own mask row): what keeps a tree's verify and plain decoding on the same
    logits. At head sizes the vector scores take (a multiple of 8 / 16) and one they do not."""
    g = torch.Generator().manual_seed(hd)
    heads, kv_heads, k, nb = 6, 2, 5, 11
    kc, vc = torch.randn(256, kv_heads, hd, generator=g), torch.randn(256, kv_heads, hd, generator=g)
    table = torch.randperm(256 // bs, generator=g)[:nb][None]
    t = nb * bs - 3
    mask = torch.zeros(1, 1, k, nb * bs, dtype=torch.bool)
    mask[..., :t - k] = True                                   # the context, then a chain of k nodes
    mask[0, 0, :, t - k:t] = torch.tril(torch.ones(k, k, dtype=torch.bool))
    q = torch.randn(1, heads, k, hd, generator=g)
    together = blocks.paged_attention(q, kc, vc, table, bs, mask, 0.2)
    for i in range(k):
        alone = blocks.paged_attention(q[:, :, i:i + 1], kc, vc, table, bs, mask[:, :, i:i + 1], 0.2)
        assert torch.equal(together[:, :, i:i + 1], alone), i
    want = grouped_attention(q, gather_blocks(kc, table, bs), gather_blocks(vc, table, bs),
                             attention_bias(mask, 3, torch.float32, nb * bs), 0.2)
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.skipif(not targets("__AVX2__"), reason="the compiler does not target AVX2 here: no vector scores")
def test_the_avx2_build_attends_as_the_gathered_sdpa_does(tmp_path):
    """The AVX2 form of the vector scores (8 keys at a time), built here with AVX-512 off,
    against the reference: a lane summed into the wrong score would show."""
    import ctypes

    from treespark.kernels import native

    avx2 = native.load(native.build(tmp_path, ("-mno-avx512f",)))
    g = torch.Generator().manual_seed(5)
    b, heads, kv_heads, k, hd, bs, nb = 2, 6, 2, 3, 32, 4, 9
    kc, vc = torch.randn(128, kv_heads, hd, generator=g), torch.randn(128, kv_heads, hd, generator=g)
    table = torch.stack([torch.randperm(128 // bs, generator=g)[:nb] for _ in range(b)])
    mask = torch.rand(b, 1, k, nb * bs, generator=g) < 0.7
    mask[..., 0] = True
    bias = attention_bias(mask, heads // kv_heads, torch.float32, nb * bs)
    q = torch.randn(b, heads, k, hd, generator=g)
    splits = -(-nb // blocks.SPAN_BLOCKS)
    scratch = torch.empty(b * kv_heads * splits * (heads // kv_heads) * k * (blocks.SPAN_BLOCKS * bs + hd + 2))
    out = torch.empty(b, heads, k, hd)
    assert avx2.ts_paged_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), table.data_ptr(), nb, bs,
                                   mask.view(torch.uint8).data_ptr(), nb * bs, 0.3, scratch.data_ptr(), out.data_ptr(), b, heads, kv_heads, k,
                                   hd, blocks.SPAN_BLOCKS, ctypes.c_int(1)) == 0
    want = grouped_attention(q, gather_blocks(kc, table, bs), gather_blocks(vc, table, bs), bias, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _paged_forward(runner: TargetRunner, seq: torch.Tensor, k: int, bs: int = 4):
    """Rows ``seq`` [B, n] over their own shuffled blocks of one paged store: the prefix
    in one forward (torch's operators: more than MAX_ROWS tokens), then the last ``k``
    tokens of each row under a tree-like mask (each token its ancestors: here the row's
    prefix, itself and every second token before it). Returns the second forward's logits
    and taps, and the store."""
    b, n = seq.shape
    n0 = n - k
    nb = -(-n // bs)
    g = torch.Generator().manual_seed(n * 10 + k)
    table = torch.randperm(4 * b * nb, generator=g)[:b * nb].view(b, nb) + 1      # block 0: the null block
    store = PagedStore(runner.store_shape, (4 * b * nb + 1) * bs, torch.device("cpu"), torch.float32)
    pos = torch.arange(n)
    rows = PagedRows(table, bs, n)
    runner.forward(seq[:, :n0], pos[None, :n0].expand(b, -1), pos[None, :n0].expand(b, -1), store, rows,
                   torch.ones(n0, n0, dtype=torch.bool).tril()[None, None].expand(b, -1, -1, -1))
    mask = torch.zeros(k, n, dtype=torch.bool)
    mask[:, :n0] = True
    for i in range(k):
        mask[i, n0 + i] = True
        mask[i, n0 + i % 2:n0 + i:2] = True
    out = runner.forward(seq[:, n0:], pos[None, n0:].expand(b, -1), pos[None, n0:].expand(b, -1), store, rows,
                         mask[None, None].expand(b, -1, -1, -1).contiguous())
    return out.logits, out.taps, store


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("layout", [NATIVE, HALF])
def test_the_layer_stack_in_one_call_gives_the_per_layer_calls_floats(family, layout, monkeypatch):
    """A decoding step over a paged store runs every layer in one native call
    (``blocks.layers``): its logits, taps and written keys and values are the per-layer
    calls' to the bit; other forwards (the prefix: more than MAX_ROWS tokens) do not."""
    model = _target(family)
    if layout == HALF:
        round_to_bf16(model)
    plan = ProductPlan((MAX_ROWS, MAX_ROWS + 1), (layout, F_LINEAR))
    taps = (0, 1, model.config.num_hidden_layers - 1)
    one_call, per_layer = TargetRunner(model, taps, plan), TargetRunner(model, taps, plan)
    stacked = []
    real = blocks.layers
    monkeypatch.setattr(blocks, "layers", lambda *a, **kw: stacked.append(1) or real(*a, **kw))
    seq = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(9))
    for b, k in ((1, 1), (2, 3), (1, MAX_ROWS), (2, MAX_ROWS // 2)):
        before = len(stacked)
        got = _paged_forward(one_call, seq[:b], k)
        assert len(stacked) - before == 1, "the k-token forward in one call, the prefix not"
        with monkeypatch.context() as m:
            m.setattr(target, "stacked", lambda attend: None)
            want = _paged_forward(per_layer, seq[:b], k)
        assert len(stacked) - before == 1
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[2].k, want[2].k) and torch.equal(got[2].v, want[2].v)


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_amx_tiles_the_layer_stack_takes_a_batch_of_trees(family, monkeypatch):
    """Where every bfloat16 copy is AMX tiles (flat cost in the rows), a step of more than
    MAX_ROWS query tokens (two rows of 20) runs in the one native call too, and gives the
    torch forward's logits; past TILE_ROWS it does not."""
    model = _target(family)
    round_to_bf16(model)
    plan = ProductPlan.fixed(HALF)
    stacked_runner, torch_runner = TargetRunner(model, (0, 1), plan), TargetRunner(model, (0, 1), plan)
    if not stacked_runner._half_tiles():
        pytest.skip("no AMX tiles here (the CPU, the compiler or the OS), or a width they do not take")
    torch_runner._blocks = False
    stacked = []
    real = blocks.layers
    monkeypatch.setattr(blocks, "layers", lambda *a, **kw: stacked.append(a[1].shape[0]) or real(*a, **kw))
    seq = torch.randint(0, model.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(11))
    got = _paged_forward(stacked_runner, seq, 20)
    assert stacked == [40], "the 2 x 20-token step in one call, the prefix not"
    want = _paged_forward(torch_runner, seq, 20)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert not blocks.can_run(blocks.TILE_ROWS + 1, "silu", tiles=True) and blocks.can_run(40, "silu", tiles=True)
    assert not blocks.can_run(MAX_ROWS + 1, "silu")


@needs_native
def test_the_native_attention_reads_the_mask_and_never_makes_the_bias():
    """A paged forward's attention prepared once (``table_attention``): the few-token
    queries the native attention takes leave the additive bias unmade; a wide one (SDPA)
    makes it, once, and both give the reference's values."""
    from treespark.engine.attend import table_attention
    from treespark.engine.kv import PagedStore, StoreShape

    g = torch.Generator().manual_seed(3)
    bs, nb, hd, heads, kv_heads = 4, 6, 16, 4, 2
    store = PagedStore(StoreShape(1, kv_heads, hd), 64, torch.device("cpu"), torch.float32)
    store.k.copy_(torch.randn(store.k.shape, generator=g))
    store.v.copy_(torch.randn(store.v.shape, generator=g))
    table = torch.randperm(64 // bs, generator=g)[:nb][None]
    for k in (3, MAX_ROWS + 1):
        mask = torch.rand(1, 1, k, nb * bs - 2, generator=g) < 0.6
        mask[..., 0] = True
        attend = table_attention(store, table, bs, mask, torch.zeros(1, k, dtype=torch.long), groups=heads // kv_heads,
                                 dtype=torch.float32, scale=0.25)
        q = torch.randn(1, heads, k, hd, generator=g)
        got = attend(0, q)
        assert ("bias" in vars(attend)) == (k > MAX_ROWS)
        want = grouped_attention(q, gather_blocks(store.k[0], table, bs), gather_blocks(store.v[0], table, bs),
                                 attention_bias(mask, heads // kv_heads, torch.float32, nb * bs), 0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _prefill_step(runner: TargetRunner, trees: int, seed: int, first: int = 5):
    """A packed prefill of three chunks (one of ``first`` tokens at its prompt's start, two
    past earlier chunks of theirs, over shuffled blocks of random keys) over a fresh paged
    store; with ``trees`` > 0, a decode step's batch of that many rows of 3 tree tokens in
    the same forward first (``MixedAttention``), as a step whose chunks ride in its verify
    forward. Returns the forward's logits and taps, and the store."""
    from tests.engine.test_prefill import _request
    from treespark.engine.attend import MixedAttention, chunk_attention, table_attention
    from treespark.engine.kv import PagedKV
    from treespark.engine.prefill import prefill_batch

    g = torch.Generator().manual_seed(seed)
    bs, v = 4, runner.vocab_size
    own = -(-(first + 4) // bs)                                         # the first request's blocks
    kv = PagedKV(runner.store_shape, runner.store_shape, num_blocks=own + 36, block_size=bs,
                 device=torch.device("cpu"), dtype=torch.float32)
    for t in (kv.target.k, kv.target.v):
        t[:, bs:] = torch.randn(t[:, bs:].shape, generator=g)         # every context before the chunks
    order = (torch.randperm(own + 35, generator=g) + 1).tolist()
    prompts = [torch.randint(0, v, (n,), generator=g).tolist() for n in (first + 4, 14, 6)]
    held = [order[:own], order[own:own + 4], order[own + 4:own + 8]]
    reqs = [_request(str(i), p, held[i], c) for i, (p, c) in enumerate(zip(prompts, (0, 6, 2), strict=True))]
    batch = prefill_batch(list(zip(reqs, (first, 4, 3), strict=True)), kv)
    pos, slots = torch.as_tensor(batch.positions), torch.as_tensor(batch.slots)
    attend = chunk_attention(runner.attention, kv, slots, pos, torch.as_tensor(batch.tables), list(batch.spans),
                             torch.as_tensor(np.asarray(batch.spans, dtype=np.int64)), groups=runner.groups,
                             dtype=runner.dtype, scale=runner.scaling)
    assert attend.packed is not None
    tokens, positions = torch.as_tensor(batch.tokens), pos
    if trees:
        k, ctx = 3, 7                                                   # each row's 7 keys, then its tree
        table = torch.as_tensor(order[own + 8:own + 8 + 3 * trees]).view(trees, 3)
        tree_pos = torch.full((trees, k), ctx) + torch.tensor([0, 1, 1])   # a root and its two children
        mask = torch.zeros(trees, 1, k, ctx + k, dtype=torch.bool)
        mask[..., :ctx] = True
        mask[..., torch.arange(k), ctx + torch.arange(k)] = True
        mask[..., 1:, ctx] = True
        tree_slots = table.gather(1, (ctx + torch.arange(k))[None].expand(trees, -1) // bs) * bs + (ctx + torch.arange(k)) % bs
        store_part = table_attention(kv.target, table, bs, mask, tree_slots, groups=runner.groups, dtype=runner.dtype,
                                     scale=runner.scaling)
        attend = MixedAttention(store_part, attend, trees, k)
        tokens = torch.cat([torch.randint(0, v, (trees * k,), generator=g), tokens])
        positions = torch.cat([tree_pos.flatten(), positions])
    out = runner.run(tokens[None], positions[None], attend)
    return out.logits, out.taps, kv


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("layout", [NATIVE, HALF])
@pytest.mark.parametrize("trees", [0, 1])
def test_the_layer_stack_in_one_call_takes_a_packed_prefill_and_a_mixed_step(family, layout, trees, monkeypatch):
    """A packed prefill's chunks (``ChunkAttention`` with its native call), and a decode
    step's trees with chunks riding in its forward (``MixedAttention``), run every layer
    in one native call too: logits, taps and the keys and values written are the
    per-layer calls' to the bit."""
    from treespark.kernels.chunks import can_attend

    if not can_attend(torch.float32, torch.zeros(1, 1, 16)):
        pytest.skip("no native chunk attention here")
    model = _target(family)
    if layout == HALF:
        round_to_bf16(model)
    plan = ProductPlan((MAX_ROWS, MAX_ROWS + 1), (layout, F_LINEAR))
    taps = (0, model.config.num_hidden_layers - 1)
    stacked = []
    real = blocks.layers
    monkeypatch.setattr(blocks, "layers", lambda *a, **kw: stacked.append(a[1].shape[0]) or real(*a, **kw))
    got = _prefill_step(TargetRunner(model, taps, plan), trees, seed=21)
    assert stacked == [12 + 3 * trees], "the step's every layer in one call"
    with monkeypatch.context() as m:
        m.setattr(target, "stacked", lambda attend: None)
        want = _prefill_step(TargetRunner(model, taps, plan), trees, seed=21)
    assert len(stacked) == 1, "the per-layer calls"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2].target.k, want[2].target.k) and torch.equal(got[2].target.v, want[2].target.v)


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_amx_tiles_a_long_packed_prefill_runs_in_the_one_call(family, monkeypatch):
    """Where every bfloat16 copy is AMX tiles, a packed prefill of more than TILE_ROWS tokens
    with a decode step's tree riding runs every layer in one native call: a prefill's rows
    do not count against the trees' limit (its products take any rows, its attention any
    chunks); the per-layer calls' floats to the bit. Without tiles they count."""
    from treespark.kernels.chunks import can_attend

    model = _target(family)
    round_to_bf16(model)
    plan = ProductPlan.fixed(HALF)
    taps = (0, model.config.num_hidden_layers - 1)
    if not TargetRunner(model, taps, plan)._half_tiles() or not can_attend(torch.float32, torch.zeros(1, 1, 16)):
        pytest.skip("no AMX tiles or native chunk attention here")
    first = blocks.TILE_ROWS + 36
    stacked = []
    real = blocks.layers
    monkeypatch.setattr(blocks, "layers", lambda *a, **kw: stacked.append(a[1].shape[0]) or real(*a, **kw))
    got = _prefill_step(TargetRunner(model, taps, plan), 1, seed=23, first=first)
    assert stacked == [3 + first + 7], "the step's every layer in one call"
    with monkeypatch.context() as m:
        m.setattr(target, "stacked", lambda attend: None)
        want = _prefill_step(TargetRunner(model, taps, plan), 1, seed=23, first=first)
    assert len(stacked) == 1, "the per-layer calls"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2].target.k, want[2].target.k) and torch.equal(got[2].target.v, want[2].target.v)
    assert blocks.can_run(blocks.TILE_ROWS + first, "silu", tiles=True, chunk_rows=first)
    assert not blocks.can_run(blocks.TILE_ROWS + 1 + first, "silu", tiles=True, chunk_rows=first)
    assert not blocks.can_run(MAX_ROWS + first, "silu", chunk_rows=first)


@needs_native
@pytest.mark.parametrize("half", [False, True])
def test_norm_linear_is_the_norm_then_the_product(half):
    """A forward's final norm and LM head in one call (``blocks.norm_linear``) give
    ``add_norm``'s norm times ``native_linear``'s product to the bit, on float32 weights
    and on their bfloat16 panels, into the room given."""
    from treespark.kernels.native import exact_panels, native_linear

    g = torch.Generator().manual_seed(12)
    x, norm_w = torch.randn(5, 64, generator=g), torch.rand(64, generator=g) + 0.5
    w = torch.randn(96, 64, generator=g)
    if half:
        w = exact_panels(w.bfloat16().float())
        assert w is not None
    room = torch.full((5 * 96 + 7,), float("nan"))
    got = blocks.norm_linear(x, norm_w, 1e-6, w, None, room)
    want = native_linear(blocks.add_norm(x, None, norm_w, 1e-6)[1], w)
    assert torch.equal(got, want) and got.data_ptr() == room.data_ptr()

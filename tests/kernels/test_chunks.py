"""The native attention of a prefill's packed chunks (``treespark.kernels.chunks``): each
chunk's queries over its own blocks up to their positions, against SDPA with the causal
mask over the gathered keys; a query's values independent of how the prompt is chunked,
of the chunks beside it and of the threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_native import targets
from treespark.kernels import chunks
from treespark.kernels.native import library

pytestmark = pytest.mark.skipif(library() is None or library().ts_chunk_lanes() == 0,
                                reason="no native library with a vector form")


def _pool(kvh: int, hd: int, blocks: int, bs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(blocks * bs, kvh, hd, generator=g), torch.randn(blocks * bs, kvh, hd, generator=g),
            torch.randperm(blocks, generator=g))


def _packed(tables, spans, bs):
    return chunks.PackedChunks(tables.to(torch.int64).contiguous(), torch.tensor(spans, dtype=torch.int64), bs)


def _reference(q, kc, vc, tables, spans, bs, scale):
    """Chunk by chunk: its keys 0 .. start + size - 1 gathered slot by slot, SDPA with the
    causal mask (grouped-query heads left to the kernel)."""
    outs = []
    for i, (offset, size, start) in enumerate(spans):
        t = start + size
        pos = torch.arange(t)
        slots = tables[i, pos // bs] * bs + pos % bs
        k, v = kc[slots].transpose(0, 1)[None], vc[slots].transpose(0, 1)[None]
        mask = (pos[None, :] <= torch.arange(start, t)[:, None])[None, None]
        outs.append(F.scaled_dot_product_attention(q[:, :, offset:offset + size], k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=True))
    return torch.cat(outs, dim=2)


def _layout(chunk_list, bs, order):
    """tables [C, nb] (each chunk its own blocks, taken in ``order``), spans, tokens."""
    nb = max(-(-(start + size) // bs) for size, start in chunk_list)
    tables = torch.zeros(len(chunk_list), nb, dtype=torch.int64)
    spans, offset, used = [], 0, 0
    for i, (size, start) in enumerate(chunk_list):
        need = -(-(start + size) // bs)
        tables[i, :need] = order[used:used + need]
        used += need
        spans.append((offset, size, start))
        offset += size
    return tables, spans, offset


@pytest.mark.parametrize(("heads", "kv_heads", "hd", "bs"), [(4, 2, 16, 16), (9, 3, 64, 16), (6, 6, 24, 4),
                                                             (8, 1, 8, 16)])
def test_chunks_are_the_causal_attention_over_their_own_blocks(heads, kv_heads, hd, bs):
    """Chunks at their prompts' start, mid-prompt past a block edge, one token, sizes that
    leave a tile's lanes spare, tiles starting on and just before an edge of the kernel's
    8-key blocks (the diagonal's mask); heads of 8 to 64 (not only multiples of the vector)."""
    chunk_list = [(37, 0), (200, 301), (1, 64), (33, 15), (16, 16), (40, 6)]
    kc, vc, order = _pool(kv_heads, hd, 2048 // bs, bs)
    tables, spans, n = _layout(chunk_list, bs, order)
    q = torch.randn(1, heads, n, hd, generator=torch.Generator().manual_seed(1))
    scale = hd ** -0.5
    out = chunks.chunk_attention(q, kc, vc, _packed(tables, spans, bs), scale)
    torch.testing.assert_close(out, _reference(q, kc, vc, tables, spans, bs, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("hd", [16, 64])
def test_a_querys_values_do_not_depend_on_the_chunking_the_batch_or_the_threads(hd):
    """One 300-token prompt attended as one chunk, as chunks of 100 / 150 / 50 (each in its
    own call, as successive prefill steps run them), and beside another request's chunk,
    at one and at two threads: the same floats, bit for bit (heads of 16: the vector form;
    of 64: the tile form where the CPU has AMX)."""
    bs = 16
    kc, vc, order = _pool(2, hd, 48, bs)
    q = torch.randn(1, 4, 300, hd, generator=torch.Generator().manual_seed(2))
    table = order[:19][None]                                    # the prompt's blocks
    other = order[19:30][None]
    whole = chunks.chunk_attention(q, kc, vc, _packed(table, [(0, 300, 0)], bs), 0.25)
    parts = []
    for start, size in ((0, 100), (100, 150), (250, 50)):
        packed = _packed(table, [(0, size, start)], bs)
        parts.append(chunks.chunk_attention(q[:, :, start:start + size], kc, vc, packed, 0.25))
    assert torch.equal(torch.cat(parts, dim=2), whole)
    beside = torch.cat([torch.randn(1, 4, 170, hd, generator=torch.Generator().manual_seed(3)), q[:, :, 100:250]], 2)
    tables = torch.cat([torch.nn.functional.pad(other, (0, 8)), table])
    packed = _packed(tables, [(0, 170, 0), (170, 150, 100)], bs)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(chunks.chunk_attention(beside, kc, vc, packed, 0.25)[:, :, 170:], parts[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("hd", [64, 128])
def test_the_tile_and_vector_forms_attend_as_sdpa_does_where_scores_run_far(tmp_path, hd):
    """Heads of 64 and 128 (the tile form where AMX is here) and the vector form built
    without it, with queries scaled so that the scores span hundreds of log2 units and a
    lane's maximum keeps moving past the one its weights are taken against (the tile
    form's lazy rescale), chunks long and short, over one and several key blocks: each
    within twice SDPA's own float32 error of the float64 attention (~4e-5 here)."""
    from tests.kernels.test_native import NO_TILES
    from treespark.kernels import native

    vector = native.load(native.build(tmp_path, NO_TILES))
    chunk_list = [(150, 0), (33, 200), (1, 7), (70, 64)]
    kc, vc, order = _pool(2, hd, 1024 // 16, 16, seed=5)
    tables, spans, n = _layout(chunk_list, 16, order)
    q = torch.randn(1, 4, n, hd, generator=torch.Generator().manual_seed(6))
    q = q * torch.linspace(0.5, 40.0, n)[None, None, :, None]      # later queries' scores far wider
    scale = hd ** -0.5
    exact = _reference(q.double(), kc.double(), vc.double(), tables, spans, 16, scale)
    bound = 2 * (_reference(q, kc, vc, tables, spans, 16, scale).double() - exact).abs().max()
    packed = _packed(tables, spans, 16)
    tile = chunks.chunk_attention(q, kc, vc, packed, scale)
    out = torch.empty(1, 4, n, hd)
    assert vector.ts_chunk_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), packed.tables.data_ptr(),
                                     tables.shape[1], 16, packed.spans.data_ptr(), len(spans), scale, out.data_ptr(),
                                     4, 2, n, hd, 1) == 0
    for got in (tile, out):
        assert (got.double() - exact).abs().max() <= bound


def test_what_the_native_chunks_take():
    cache = torch.zeros(64, 2, 16)
    assert chunks.can_attend(torch.float32, cache)
    assert not chunks.can_attend(torch.bfloat16, cache)
    assert not chunks.can_attend(torch.float32, cache.to(torch.bfloat16))
    assert not chunks.can_attend(torch.float32, torch.zeros(64, 2, chunks.MAX_HEAD + 16))
    with pytest.raises(ValueError, match="span per table row"):
        _packed(torch.zeros(2, 1, dtype=torch.int64), [(0, 8, 0)], 16)
    q = torch.zeros(1, 4, 8, 16)
    bad = _packed(torch.zeros(1, 1, dtype=torch.int64), [(0, 8, 12)], 16)   # past its blocks
    with pytest.raises(ValueError, match="refused"):
        chunks.chunk_attention(q, cache, cache, bad, 0.25)


@pytest.mark.skipif(not targets("__AVX2__"), reason="the compiler does not target AVX2 here")
def test_the_avx2_build_attends_the_chunks_as_sdpa_does(tmp_path):
    """The AVX2 form (8 query lanes a vector), built here with AVX-512 off, against the
    reference: a lane, a mask or a rescale wrong in that form would show."""
    import ctypes

    from treespark.kernels import native

    avx2 = native.load(native.build(tmp_path, ("-mno-avx512f",)))
    assert avx2.ts_chunk_lanes() == 8
    kc, vc, order = _pool(2, 24, 512, 4)
    tables, spans, n = _layout([(37, 0), (20, 45), (1, 9)], 4, order)
    q = torch.randn(1, 6, n, 24, generator=torch.Generator().manual_seed(4))
    packed = _packed(tables, spans, 4)
    out = torch.empty(1, 6, n, 24)
    assert avx2.ts_chunk_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), packed.tables.data_ptr(),
                                   tables.shape[1], 4, packed.spans.data_ptr(), len(spans), 0.2, out.data_ptr(), 6, 2,
                                   n, 24, ctypes.c_int(1)) == 0
    torch.testing.assert_close(out, _reference(q, kc, vc, tables, spans, 4, 0.2), atol=2e-6, rtol=1e-5)

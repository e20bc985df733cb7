"""The argmax (native, or blocked without the library) and the blocked top-k over the
vocabulary (``treespark.kernels.vocab``) against torch's own, on rows made to catch a
wrong block or a wrong place inside one.

(``bench``: ``python -c "import torch, timeit; from treespark.kernels import vocab;
torch.set_num_threads(1); x = torch.randn(8, 16, 151936); print(timeit.timeit(lambda:
vocab.argmax(x), number=10), timeit.timeit(lambda: x.argmax(-1), number=10))"``.)
"""

from __future__ import annotations

import pytest
import torch

from treespark.kernels import vocab

V = 151_936  # Qwen3's vocabulary: 1,187 blocks


def _rows(g: torch.Generator, n: int, v: int = V) -> torch.Tensor:
    return torch.randn(n, v, generator=g)


def test_vocabulary_rows_take_the_blocked_path_and_short_ones_do_not():
    assert vocab._blocked(torch.zeros(2, V), 1) and vocab._blocked(torch.zeros(2, 49_152), 16)
    assert not vocab._blocked(torch.zeros(2, 512), 1)        # too short to gain
    assert not vocab._blocked(torch.zeros(2, V + 1), 1)      # not whole blocks


@pytest.mark.parametrize("dtype,native", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)])
def test_argmax_is_torchs_first_maximal_index(dtype, native, monkeypatch):
    """Either way (the native call on float32 rows where the library is built; the blocks
    without it, or on bfloat16), torch's first maximal index."""
    if native and vocab.library() is None:
        pytest.skip("no native library here")
    calls = []
    if native:
        real = vocab.library()
        monkeypatch.setattr(vocab, "library", lambda: calls.append(1) or real)
    else:
        monkeypatch.setattr(vocab, "library", lambda: None)
    g = torch.Generator().manual_seed(0)
    x = _rows(g, 12).to(dtype)
    top = x.max() + 1
    x[0, 5] = top                                  # first block, early
    x[1, V - 1] = top                              # last element of the last block
    x[2, 130], x[2, 200] = top, top                # a tie inside one block: the first
    x[3, 70_001], x[3, 3] = top, top               # a tie across blocks: the earlier block
    x[4, 127], x[4, 128] = top, top                # either side of a block boundary
    x[5, 9_000], x[5, 40] = float("nan"), float("nan")   # NaN counts as the maximum, first one wins
    x[6] = float("-inf")                           # nothing finite: index 0
    x[7, 77_777] = float("inf")
    x[8] = 0.0                                     # all equal
    got = vocab.argmax(x)
    assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    assert got[:9].tolist() == [5, V - 1, 130, 3, 127, 40, 0, 77_777, 0]
    assert bool(calls) == native


def test_argmax_keeps_the_leading_shape_and_takes_a_strided_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, V, generator=g)
    assert torch.equal(vocab.argmax(x), x.argmax(-1)) and vocab.argmax(x).shape == (3, 5)
    strided = x[:, ::2]                                          # rows not adjacent in memory
    assert torch.equal(vocab.argmax(strided), strided.argmax(-1))
    one = x[0, 0]
    assert vocab.argmax(one).shape == () and int(vocab.argmax(one)) == int(one.argmax())


@pytest.mark.parametrize("m", [1, 8, 16])
def test_top_k_gives_torchs_values_and_indices(m):
    g = torch.Generator().manual_seed(2)
    x = _rows(g, 9)
    x[0, 1000:1000 + m] = 50.0 + torch.arange(m, dtype=torch.float32)   # all top values in one block
    x[1, torch.arange(m) * 997] = 50.0 + torch.arange(m, dtype=torch.float32)  # each in its own block
    x[2, -m:] = 50.0 + torch.arange(m, dtype=torch.float32)             # at the row's end
    got, want = vocab.topk(x, m), x.topk(m, dim=-1)
    assert torch.equal(got.values, want.values)
    assert torch.equal(got.indices, want.indices)


def test_top_k_between_equal_values_returns_distinct_indices_of_those_values():
    g = torch.Generator().manual_seed(3)
    x = _rows(g, 4)
    x[:, torch.arange(20) * 500] = 9.0                         # 20 equal values, more than m
    got = vocab.topk(x, 16)
    assert torch.equal(got.values, torch.full((4, 16), 9.0))
    assert all(len(set(r)) == 16 and all(i % 500 == 0 and i < 10_000 for i in r) for r in got.indices.tolist())


def test_short_rows_and_other_shapes_fall_back_to_torch():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 512, generator=g)
    assert torch.equal(vocab.argmax(x), x.argmax(-1))
    assert torch.equal(vocab.topk(x, 16).indices, x.topk(16, dim=-1).indices)
    empty = torch.zeros(0, V)
    assert vocab.topk(empty, 8).values.shape == (0, 8) and vocab.argmax(empty).shape == (0,)


@pytest.mark.skipif(vocab.library() is None, reason="no native library here")
def test_the_plain_c_argmax_without_avx512_is_the_same(tmp_path):
    """``vocab.c``'s loops without AVX-512 (built here with it off) on the same rows."""
    import ctypes

    from treespark.kernels import native

    plain = native.load(native.build(tmp_path, ("-mno-avx512f",)))
    g = torch.Generator().manual_seed(5)
    x = _rows(g, 4, 4_100)
    x[1, 4_099] = 99.0                                         # the last, past the vector steps
    x[2, 17], x[2, 3_000] = float("nan"), 99.0                 # a NaN wins over a larger number
    x[3] = float("-inf")
    out = torch.empty(4, dtype=torch.int64)
    assert plain.ts_argmax_rows(x.data_ptr(), 4, 4_100, out.data_ptr(), ctypes.c_int(1)) == 0
    assert torch.equal(out, x.argmax(-1)) and out[1:].tolist() == [4_099, 17, 0]

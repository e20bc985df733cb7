"""The attention maths (``treespark.kernels.attention``): the grouped path computes what
the reference computes, whatever lies in the key columns the mask hides."""

from __future__ import annotations

import pytest
import torch

from treespark.kernels.attention import (
    DenseKV,
    attention_bias,
    gather_blocks,
    grouped_attention,
    reference_attention,
)


def _inputs(b, h, kvh, k, t, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, k, hd, generator=g).to(dtype)
    keys = torch.randn(b, kvh, t, hd, generator=g).to(dtype)
    values = torch.randn(b, kvh, t, hd, generator=g).to(dtype)
    # a tree-shaped mask: each row its own context length, each query its own visible set,
    # every query sees column 0 (no all-masked rows, as the engine's masks)
    mask = torch.rand(b, 1, k, t, generator=g) < 0.6
    lens = torch.randint(1, t + 1, (b,), generator=g)
    mask &= torch.arange(t)[None, None, None] < lens[:, None, None, None]
    mask[..., 0] = True
    return q, keys, values, mask


@pytest.mark.parametrize(("h", "kvh"), [(4, 2), (8, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_equals_the_reference(h, kvh, dtype):
    q, keys, values, mask = _inputs(3, h, kvh, 7, 37, 16, dtype)
    ref = reference_attention(q, keys, values, mask, scale=0.3)
    got = grouped_attention(q, keys, values, attention_bias(mask, h // kvh, dtype, 37), scale=0.3)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, ref, **tol)


def test_padded_key_columns_are_never_seen():
    """The bias' key axis is padded to a block multiple: whatever the padding holds (here
    huge values), the output is the unpadded one."""
    q, keys, values, mask = _inputs(2, 4, 2, 5, 21, 8, torch.float32, seed=1)
    t = 32                                                               # 21 keys padded to 2 blocks of 16
    junk = torch.full((2, 2, t - 21, 8), 1e4)
    got = grouped_attention(q, torch.cat([keys, junk], 2), torch.cat([values, junk], 2),
                            attention_bias(mask, 2, torch.float32, t))
    torch.testing.assert_close(got, reference_attention(q, keys, values, mask))
    bias = attention_bias(mask, 2, torch.float32, t)
    assert bias.shape == (2, 1, 10, 32) and torch.isinf(bias[..., 21:]).all()


def test_gather_blocks_is_the_slot_gather():
    g = torch.Generator().manual_seed(2)
    bs, kvh, hd = 4, 2, 3
    cache = torch.randn(10 * bs, kvh, hd, generator=g)                  # [slots, kvh, hd]
    table = torch.tensor([[3, 7, 1], [9, 0, 0]])                         # [B, nb], 0: the null block
    got = gather_blocks(cache, table, bs)                                # [B, kvh, nb*bs, hd]
    cols = torch.arange(3 * bs)
    slots = table[:, cols // bs] * bs + cols % bs                        # [B, T]
    torch.testing.assert_close(got, cache[slots].transpose(1, 2))


def test_dense_context_reads_a_padded_copy():
    k = torch.randn(2, 1, 2, 5, 4)
    kv = DenseKV(k, k + 1)
    keys, values = kv.read(1, 3)
    assert keys.shape == (1, 2, 8, 4)
    torch.testing.assert_close(keys[:, :, :5], k[1])
    keys.zero_()                                                         # the caller's own copy
    assert k[1].abs().sum() > 0


def _only(backend):
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([backend])


def test_grouped_attention_runs_on_the_cpu_flash_kernel():
    """On CPU the grouped call is served by the flash kernel alone (with it as the only
    backend allowed, a call it cannot take would raise)."""
    from torch.nn.attention import SDPBackend

    q, keys, values, mask = _inputs(2, 8, 2, 6, 48, 16, torch.float32)
    with _only(SDPBackend.FLASH_ATTENTION):
        got = grouped_attention(q, keys, values, attention_bias(mask, 4, torch.float32, 48))
    torch.testing.assert_close(got, reference_attention(q, keys, values, mask))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_runs_on_the_cuda_memory_efficient_kernel(dtype):
    from torch.nn.attention import SDPBackend

    q, keys, values, mask = (x.cuda() for x in _inputs(2, 8, 2, 6, 48, 16, dtype))
    with _only(SDPBackend.EFFICIENT_ATTENTION):
        got = grouped_attention(q, keys, values, attention_bias(mask, 4, dtype, 48))
    ref = reference_attention(q, keys, values, mask)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, ref, **tol)

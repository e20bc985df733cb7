"""treespark.linear: the CPU product layouts and packed weights give F.linear's values."""

import pytest
import torch
import torch.nn.functional as F

from treespark import random_pair
from treespark.kv import KVStore
from treespark.linear import (
    PACKED_MIN_ROWS,
    SMALL_ROWS,
    Linear,
    can_pack,
    linear,
    pack,
    packed_linear,
    padded_rows,
)
from treespark.target import TargetRunner


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 15, 16, 17, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(n, bias):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(n, 24, generator=g)
    y = linear(x, w, b)
    assert y.shape == (n, 40)
    assert y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_takes_any_leading_shape_and_non_contiguous_input():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 8, generator=g)
    x = torch.randn(3, 8, 2, generator=g).transpose(1, 2)  # [3, 2, 8], column-major rows
    y = linear(x, w)
    assert y.shape == (3, 2, 12) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert linear(torch.zeros(0, 8), w).shape == (0, 12)


def test_padding_rules():
    assert padded_rows(1) == 2
    assert [padded_rows(n) for n in (2, 3, 8, 9)] == [2, 3, 8, 9]
    assert all(padded_rows(n) == 16 for n in range(10, 16))
    assert padded_rows(16) == 16 and padded_rows(SMALL_ROWS) == SMALL_ROWS


def test_linear_module_keeps_nn_linear_state_dict_and_gradients():
    a, b = Linear(6, 4), torch.nn.Linear(6, 4)
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(3, 6, requires_grad=True)
    a(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    b(x).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(a.weight.grad, b.weight.grad)


needs_onednn = pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="this PyTorch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("n", [1, 3, 8, 33])
def test_packed_linear_matches_f_linear(n):
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(2, n, 24, generator=g)
    for bias in (None, b):
        torch.testing.assert_close(packed_linear(x, pack(w, bias)), F.linear(x, w, bias),
                                   rtol=1e-5, atol=1e-5)


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="bfloat16"):
        pack(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        pack(torch.zeros(4))


@needs_onednn
def test_target_runner_packs_and_matches_the_model_at_every_row_count():
    """The runner's logits (plain products below PACKED_MIN_ROWS rows, packed ones
    above) equal the transformers forward of the same sequence."""
    pair = random_pair(64, 3)
    runner = TargetRunner(pair.target, (0,))
    assert runner._packed, "a float32 CPU target gets packed weights"
    seq = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = pair.target(seq).logits[0]
    for k in (1, 2, PACKED_MIN_ROWS, 8, 20):
        store = KVStore(runner.store_shape, 1, 32, torch.device("cpu"), torch.float32)
        n0 = 24 - k
        if n0:  # the prefix first, in one forward
            pos = torch.arange(n0)[None]
            runner.forward(seq[:, :n0], pos, pos, store, slice(0, 1),
                           torch.ones(n0, n0, dtype=torch.bool).tril()[None, None])
        pos = torch.arange(n0, 24)[None]
        mask = torch.ones(k, 24, dtype=torch.bool).tril(n0)[None, None]
        out = runner.forward(seq[:, n0:], pos, pos, store, slice(0, 1), mask)
        torch.testing.assert_close(out.logits[0], ref[n0:], rtol=1e-4, atol=1e-4)


def _runner_logits(runner: TargetRunner, seq: torch.Tensor) -> torch.Tensor:
    """The runner's logits over ``seq`` [1, n] in one causal forward (n >= PACKED_MIN_ROWS)."""
    n = seq.shape[1]
    store = KVStore(runner.store_shape, 1, n, torch.device("cpu"), torch.float32)
    pos = torch.arange(n)[None]
    return runner.forward(seq, pos, pos, store, slice(0, 1),
                          torch.ones(n, n, dtype=torch.bool).tril()[None, None]).logits[0]


@needs_onednn
def test_runners_share_the_packed_weights_and_repack_after_a_change():
    """Runners over one model share one packed copy (``generate`` builds an engine per
    call); a runner built after an in-place change to a weight, or after a weight was
    replaced, multiplies by the new weight."""
    pair = random_pair(64, 3)
    seq = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    first, second = TargetRunner(pair.target, (0,)), TargetRunner(pair.target, (0,))
    assert first._packed and first._packed is second._packed

    mlp = pair.target.model.layers[0].mlp
    with torch.no_grad():
        mlp.down_proj.weight.mul_(3.0)
    changed = TargetRunner(pair.target, (0,))
    assert changed._packed is not first._packed
    with torch.no_grad():
        ref = pair.target(seq).logits[0]
    torch.testing.assert_close(_runner_logits(changed, seq), ref, rtol=1e-4, atol=1e-4)

    mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(mlp.up_proj.weight))
    replaced = TargetRunner(pair.target, (0,))
    with torch.no_grad():
        ref = pair.target(seq).logits[0]
    torch.testing.assert_close(_runner_logits(replaced, seq), ref, rtol=1e-4, atol=1e-4)

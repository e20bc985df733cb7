"""The CPU forward's norms, rotation and activation as native row calls (``NATIVE_OPS``,
blocks.c's functions): the eager operators' values to float rounding, at a prefill's
many rows; the eager operators themselves where a call cannot take the tensors; and the
target's torch-operator forward on a CPU runs them."""

import pytest
import torch

from tests.engine.test_fused_forward import _logits, _target
from treespark.engine.target import TargetRunner
from treespark.kernels import blocks
from treespark.kernels.layer_ops import EAGER, NATIVE_OPS, rope_sign
from treespark.kernels.linear import F_LINEAR, ProductPlan
from treespark.kernels.native import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler built treespark/kernels/")


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
@torch.no_grad()
def test_the_native_row_ops_are_the_eager_operators(qk_norm):
    g = torch.Generator().manual_seed(3)
    b, k, heads, kv_heads, hd, dim, inter = 2, 300, 4, 2, 16, 64, 96
    x, r = torch.randn(b, k, dim, generator=g), torch.randn(b, k, dim, generator=g)
    w = torch.rand(dim, generator=g) + 0.5
    _close(NATIVE_OPS.rms_norm(x, w, 1e-6), EAGER.rms_norm(x, w, 1e-6))
    for got, ref in zip(NATIVE_OPS.residual_rms_norm(x, r, w, 1e-6), EAGER.residual_rms_norm(x, r, w, 1e-6),
                        strict=True):
        _close(got, ref)
    gu = torch.randn(b * k, 2 * inter, generator=g)
    _close(NATIVE_OPS.act_mul(gu, "silu"), EAGER.act_mul(gu, "silu"))
    y = torch.randn(b * k, (heads + 2 * kv_heads) * hd, generator=g)
    norm = torch.rand(heads + kv_heads, hd, generator=g) + 0.5 if qk_norm else None
    angles = torch.rand(b, 1, k, hd, generator=g) * 6
    cos, ssin = angles.cos(), angles.sin() * rope_sign(hd, torch.device("cpu"), torch.float32)
    ref = EAGER.qk_norm_rope(y.clone(), b, k, heads, kv_heads, hd, norm, 1e-6, cos, ssin)
    got = NATIVE_OPS.qk_norm_rope(y, b, k, heads, kv_heads, hd, norm, 1e-6, cos, ssin)
    for a, e in zip(got, ref, strict=True):
        assert a.shape == e.shape
        _close(a, e)


@torch.no_grad()
def test_what_the_native_row_ops_cannot_take_runs_the_eager_operators(monkeypatch):
    called = []
    for name in ("add_norm", "qk_rope", "silu_rows"):
        monkeypatch.setattr(blocks, name, lambda *a, _n=name, **kw: called.append(_n))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(NATIVE_OPS.rms_norm(x, w, 1e-6), EAGER.rms_norm(x, w, 1e-6))
    per_head = torch.ones(4, 16)
    x32 = torch.randn(8, 4, 16)
    assert torch.equal(NATIVE_OPS.rms_norm(x32, per_head, 1e-6), EAGER.rms_norm(x32, per_head, 1e-6))
    gu = torch.randn(8, 64)
    assert torch.equal(NATIVE_OPS.act_mul(gu, "gelu"), EAGER.act_mul(gu, "gelu"))
    assert torch.equal(NATIVE_OPS.act_mul(gu[:, ::2], "silu"), EAGER.act_mul(gu[:, ::2], "silu"))
    assert called == []


def test_a_cpu_forward_on_torch_products_runs_the_native_row_ops(monkeypatch):
    """A 22-token prefix on F.linear (the torch-operator layers): every layer's norms,
    rotation and activation are native calls, and the logits are the eager forward's."""
    model = _target("qwen3")
    counts = {n: 0 for n in ("add_norm", "qk_rope", "silu_rows")}
    for name in counts:
        fn = getattr(blocks, name)

        def counted(*a, _fn=fn, _n=name, **kw):
            counts[_n] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(blocks, name, counted)
    seq = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    runner = TargetRunner(model, (0,), ProductPlan.fixed(F_LINEAR))
    assert runner.ops is NATIVE_OPS
    got = _logits(runner, seq, 2)
    layers = model.config.num_hidden_layers
    assert counts["qk_rope"] == counts["silu_rows"] == 2 * layers      # the prefix, then the 2 tokens
    assert counts["add_norm"] == 2 * (2 * layers + 1)                  # two norms a layer and the final one
    eager = TargetRunner(model, (0,), ProductPlan.fixed(F_LINEAR))
    eager.ops = EAGER
    torch.testing.assert_close(got, _logits(eager, seq, 2), rtol=1e-5, atol=1e-5)

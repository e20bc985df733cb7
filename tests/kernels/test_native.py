"""treespark.kernels.native: the few-row product built for this CPU gives F.linear's values,
falls back to F.linear where it does not apply, and is built once per machine."""

import pytest
import torch
import torch.nn.functional as F

from treespark.kernels import native
from treespark.kernels.linear import HALF, NATIVE, ProductPlan, planned_linear
from treespark.kernels.native import MAX_ROWS, build, can_run, library, native_linear

needs_native = pytest.mark.skipif(library() is None, reason="no C compiler built treespark/kernels/gemv.c")


@needs_native
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_native_linear_matches_f_linear_at_every_row_count(m):
    """Every row count it takes, with weight rows that are and are not a multiple of the
    4-row block, and inputs that are and are not a multiple of the 8-wide vector."""
    g = torch.Generator().manual_seed(m)
    for n, k in ((576, 576), (7, 13), (130, 1536), (4, 8), (1, 3), (49, 577)):
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        for bias in (None, b):
            torch.testing.assert_close(native_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_a_bfloat16_copy_gives_the_same_values_as_its_float32_weight(m):
    """A weight of bfloat16 values read from its bfloat16 copy: each value widened exactly
    and summed in the same order, so the very same floats, at every shape and tail."""
    g = torch.Generator().manual_seed(100 + m)
    for n, k in ((576, 576), (7, 13), (130, 1536), (4, 8), (1, 3), (49, 577)):
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        b = torch.randn(n, generator=g)
        for bias in (None, b):
            assert torch.equal(native_linear(x, w, bias), native_linear(x, w.float(), bias))
            torch.testing.assert_close(native_linear(x, w, bias), F.linear(x, w.float(), bias), rtol=1e-5, atol=1e-4)


@needs_native
def test_native_linear_keeps_leading_shape_and_takes_views():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(2, 3, 48, generator=g)[..., ::2]  # [2, 3, 24], not contiguous
    y = native_linear(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    big = torch.randn(1 << 12, 32, generator=g)      # enough to split over the threads
    torch.testing.assert_close(native_linear(big[:3], big), F.linear(big[:3], big), rtol=1e-5, atol=1e-4)


def test_native_linear_falls_back_to_f_linear_where_it_does_not_apply():
    """More rows than it takes, another dtype, a non-contiguous weight: F.linear's own result."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 8, generator=g)
    many = torch.randn(MAX_ROWS + 1, 8, generator=g)
    assert torch.equal(native_linear(many, w), F.linear(many, w))
    assert torch.equal(native_linear(many[:2].double(), w.double()), F.linear(many[:2].double(), w.double()))
    wt = torch.randn(8, 16, generator=g).T                # [16, 8], column-major
    assert not can_run(wt)
    assert torch.equal(native_linear(many[:2], wt), F.linear(many[:2], wt))
    half = w.to(torch.bfloat16)                           # past the rows it takes: widened for F.linear
    assert torch.equal(native_linear(many, half), F.linear(many, half.float()))


@needs_native
def test_the_plan_can_run_every_row_count_natively():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(10, 6, generator=g), torch.randn(10, generator=g)
    for n in (1, 5, MAX_ROWS, MAX_ROWS + 3):
        x = torch.randn(n, 6, generator=g)
        torch.testing.assert_close(planned_linear(x, w, b, ProductPlan.fixed(NATIVE)), F.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)


@needs_native
def test_the_half_layout_reads_the_copy_and_refuses_without_one():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 9, generator=g).to(torch.bfloat16).float()
    x = torch.randn(3, 9, generator=g)
    plan = ProductPlan((8, 9), (HALF, NATIVE))
    assert torch.equal(planned_linear(x, w, None, plan, half=w.to(torch.bfloat16)), native_linear(x, w))
    with pytest.raises(ValueError, match="bfloat16 copies"):
        planned_linear(x, w, None, plan)


@needs_native
def test_the_library_is_built_once_per_machine_and_source(tmp_path, monkeypatch):
    first = build(tmp_path)
    assert first.exists() and first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert build(tmp_path) == first and first.stat().st_mtime_ns == stamp, "the cached build is reused"
    src = tmp_path / "blocks.c"
    src.write_text(native.SOURCES[1].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCES", (native.SOURCES[0], src))
    assert build(tmp_path) != first, "another source, another build"


def test_without_a_compiler_the_build_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        build(tmp_path)


@needs_native
def test_the_profiler_sees_a_native_product_as_an_operator():
    """Host-share figures count operator time from the profiler; a product run by ctypes
    would read as host time unless it shows as an operator."""
    from torch.profiler import profile

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(1, 256, generator=g), torch.randn(512, 256, generator=g)
    with profile() as prof:
        native_linear(x, w)
    ev = {e.key: e for e in prof.key_averages()}
    assert native.PROFILER_NAME in ev and ev[native.PROFILER_NAME].count == 1
    assert ev[native.PROFILER_NAME].self_cpu_time_total > 0

"""treespark.kernels.native: the few-row product built for this CPU gives F.linear's values,
falls back to F.linear where it does not apply, and is built once per machine."""

import pytest
import torch
import torch.nn.functional as F

from treespark.kernels import native
from treespark.kernels.linear import HALF, NATIVE, Linear, ProductPlan, planned_linear
from treespark.kernels.native import (
    MAX_ROWS,
    build,
    can_run,
    from_panels,
    library,
    load,
    native_linear,
    to_panels,
)

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
def test_bfloat16_panels_give_their_float32_weights_values(m):
    """A weight of bfloat16 values read from its panels (``to_panels``): each value widened
    exactly, so F.linear's values on the float32 weight to float rounding, at shapes whose
    inputs are and are not a multiple of the 8-wide vector; a row's values are the same
    floats whatever rows share its call."""
    g = torch.Generator().manual_seed(100 + m)
    for n, k in ((576, 576), (16, 13), (144, 1536), (32, 8), (48, 577), (4096, 64)):
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16).float()
        b = torch.randn(n, generator=g)
        panels = to_panels(w)
        assert panels.dtype == torch.bfloat16 and panels.shape == w.shape
        for bias in (None, b):
            y = native_linear(x, panels, bias)
            torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
            for i in range(m):
                assert torch.equal(native_linear(x[i:i + 1], panels, bias)[0], y[i])


def test_panels_are_the_weight_reordered():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 10, generator=g).to(torch.bfloat16)
    p = to_panels(w)
    assert torch.equal(from_panels(p), w)
    # panel 1, k = 3: rows 16 + c and 24 + c interleaved
    flat = p.view(-1)[(1 * 10 + 3) * 16:(1 * 10 + 4) * 16]
    assert torch.equal(flat[0::2], w[16:24, 3]) and torch.equal(flat[1::2], w[24:32, 3])
    with pytest.raises(ValueError, match="multiple of 16"):
        to_panels(w[:40])


def test_tile_panels_are_the_weight_reordered():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    p = to_panels(w, tiles=True)
    assert torch.equal(from_panels(p, tiles=True), w)
    # panel 1, pair of k 5: row 16 + c's weights at k = 10, 11 side by side
    flat = p.view(-1)[(1 * 32 + 5) * 32:(1 * 32 + 6) * 32]
    assert torch.equal(flat[0::2], w[16:32, 10]) and torch.equal(flat[1::2], w[16:32, 11])


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
    with pytest.raises(ValueError, match="panels"):       # panels past the rows it takes: no matrix for F.linear
        native_linear(many, to_panels(w))


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
    w = torch.randn(16, 9, generator=g).to(torch.bfloat16).float()
    x = torch.randn(3, 9, generator=g)
    plan = ProductPlan((8, 9), (HALF, NATIVE))
    half = to_panels(w)
    assert torch.equal(planned_linear(x, w, None, plan, half=half), native_linear(x, half))
    torch.testing.assert_close(planned_linear(x, w, None, plan, half=half), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bfloat16 copies"):
        planned_linear(x, w, None, plan)


@needs_native
def test_the_library_is_built_once_per_machine_and_source(tmp_path, monkeypatch):
    first = build(tmp_path)
    assert first.exists() and first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert build(tmp_path) == first and first.stat().st_mtime_ns == stamp, "the cached build is reused"
    headers = tmp_path / "include"
    headers.mkdir()
    header = headers / "vexp.h"
    header.write_text(native.HEADERS[0].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "HEADERS", (header,))
    second = build(tmp_path)
    assert second != first, "another header, another build"
    src = tmp_path / "blocks.c"
    src.write_text(native.SOURCES[1].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCES", (native.SOURCES[0], src))
    assert build(tmp_path) not in (first, second), "another source, another build"


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


@needs_native
def test_a_linear_reads_its_weights_exact_panels_and_follows_the_weight():
    """``Linear`` multiplies a few float32 rows by its weight's exact bfloat16 panels where
    they hold it, and finds them again when the weight moves."""
    lin = Linear(64, 32, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    panels = lin.panels()
    assert panels is not None and panels.dtype == torch.bfloat16
    assert torch.equal(native.from_panels(panels).float(), lin.weight)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.add_(1e-3)                       # a training step: no longer bfloat16 values
    assert lin.panels() is None
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def targets(macro: str) -> bool:
    """Whether the machine's compiler, at -march=native, defines ``macro`` (``__AVX512F__``:
    targets AVX-512)."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    out = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True)
    return macro in out.stdout


# the flag that builds the vector panels where the compiler would build the tile form (a
# compiler that does not know AMX builds no tiles, and may not know the flag either)
NO_TILES = ("-mno-amx-tile",) if targets("__AMX_TILE__") else ()


def _panels_product(lib, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import ctypes

    y = torch.empty(x.shape[0], w.shape[0])
    assert lib.ts_gemv_panels(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0],
                              w.shape[1], ctypes.c_int(torch.get_num_threads())) == 0
    return y


@needs_native
@pytest.mark.skipif(not targets("__AVX512F__"), reason="the compiler does not target AVX-512 here: one panel form only")
def test_the_avx512_panels_give_the_avx2_panels_floats(tmp_path):
    """The two vector forms of ``ts_gemv_panels`` (8 rows a pass, one FMA a row, where the
    compiler targets AVX-512; 4 rows, two FMAs, under AVX2; both built without AMX tiles)
    run each output's sum as the same chain of FMAs over k: the same floats at every row
    count."""
    avx512 = load(build(tmp_path / "avx512", NO_TILES))
    avx2 = load(build(tmp_path / "avx2", ("-mno-avx512f", *NO_TILES)))
    assert not avx512.ts_panel_tiles(576) and not avx2.ts_panel_tiles(576)
    g = torch.Generator().manual_seed(7)
    for n, k in ((576, 576), (48, 577), (1536, 64)):
        w = to_panels(torch.randn(n, k, generator=g).to(torch.bfloat16).float(), tiles=False)
        b = torch.randn(n, generator=g)
        for m in range(1, MAX_ROWS + 1):
            x = torch.randn(m, k, generator=g)
            assert torch.equal(_panels_product(avx512, x, w, b), _panels_product(avx2, x, w, b)), (m, n, k)


@needs_native
@pytest.mark.skipif(not native.tiled(64), reason="no AMX tiles here (the CPU, the compiler or the OS)")
def test_the_tile_panels_past_16_rows_give_each_row_its_own_floats():
    """A prefill's rows on the tile form: groups of 16 rows (a partial last one), four panels
    at a time with a partial last quad, the rows in blocks whose parts fit L2 (K = 1536:
    160 rows a block, so 300 rows are two), with and without a bias: each row's outputs are
    the floats it gets alone, at one and at two threads, and the float64 product's value to
    float32 summation error."""
    g = torch.Generator().manual_seed(21)
    threads = torch.get_num_threads()
    try:
        for n, k, m in ((80, 576, 17), (576, 1536, 300), (3072, 576, 40)):
            w = torch.randn(n, k, generator=g).to(torch.bfloat16).float()
            b = torch.randn(n, generator=g)
            panels = to_panels(w)
            x = torch.randn(m, k, generator=g)
            for bias in (None, b):
                want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                scale = F.linear(x.abs().double(), w.abs().double()) + (0 if bias is None else bias.abs().double())
                alone = torch.cat([native_linear(x[i:i + 1], panels, bias) for i in range(m)])
                for t in (1, 2):
                    torch.set_num_threads(t)
                    y = native_linear(x, panels, bias)
                    assert torch.equal(y, alone), (n, k, m, t)
                assert ((y.double() - want).abs() <= 4 * k * 2.0 ** -24 * scale).all(), (n, k, m)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.skipif(not native.tiled(64), reason="no AMX tiles here (the CPU, the compiler or the OS)")
def test_the_tile_panels_give_the_weights_products_exactly_summed(tmp_path):
    """On AMX, x is split exactly into three bfloat16 parts and each part's products with the
    weights are exact: every output is the float64 product's value to float32 summation
    error (no bfloat16 rounding of x: that would be ~1e-2 here), as the vector panels'
    (built without AMX) are, at every row count."""
    vector = load(build(tmp_path, NO_TILES))
    g = torch.Generator().manual_seed(8)
    for n, k in ((576, 576), (80, 1536), (48, 64)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16).float()
        b = torch.randn(n, generator=g)
        tiles, flat = to_panels(w, tiles=True), to_panels(w, tiles=False)
        for m in range(1, MAX_ROWS + 1):
            x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m).unsqueeze(1)   # rows of every scale
            want = F.linear(x.double(), w.double(), b.double())
            got = native_linear(x, tiles, b)
            scale = F.linear(x.abs().double(), w.abs().double()) + b.abs().double()   # the sum's magnitude
            assert ((got.double() - want).abs() <= 4 * k * 2.0 ** -24 * scale).all(), (m, n, k)
            torch.testing.assert_close(got, _panels_product(vector, x, flat, b), rtol=1e-5, atol=1e-4 * x.abs().max())

"""treespark.kernels.linear: the CPU product layouts and packed weights give F.linear's values,
and the product plan picks the fastest measured layout per row count."""

import json

import pytest
import torch
import torch.nn.functional as F

from treespark import random_pair
from treespark.engine.kv import KVStore
from treespark.engine.products import product_plan
from treespark.engine.target import TargetRunner
from treespark.kernels.linear import (
    F_LINEAR,
    HALF,
    LAYOUTS,
    MATVEC,
    NATIVE,
    PACKED,
    SMALL,
    SMALL_ROWS,
    Linear,
    ProductPlan,
    can_pack,
    choose_plan,
    linear,
    matvec_linear,
    measure_plan,
    pack,
    packed_linear,
    padded_rows,
    plan_sample,
    planned_linear,
)
from treespark.kernels.native import MAX_ROWS as NATIVE_ROWS
from treespark.kernels.native import library, tiled, to_panels
from treespark.models.precision import round_to_bf16


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


@pytest.mark.parametrize("n", [1, 2, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_matvec_linear_matches_f_linear(n, bias):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(1, n, 24, generator=g)
    y = matvec_linear(x, w, b)
    assert y.shape == (1, n, 40) and y.is_contiguous()
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
@pytest.mark.parametrize("layout", LAYOUTS)
def test_target_runner_matches_the_model_at_every_row_count_in_every_layout(layout):
    """With any one layout at every row count, the runner's logits equal the
    transformers forward of the same sequence (the half layout: of a target rounded to
    bfloat16 values, which it needs)."""
    pair = random_pair(64, 3)
    if layout == HALF:
        round_to_bf16(pair.target)
    runner = TargetRunner(pair.target, (0,), products=ProductPlan.fixed(layout))
    assert runner.weights.packed == (layout == PACKED), "packed copies only where the plan uses them"
    assert runner.weights.half == (layout == HALF), "half copies only where the plan uses them"
    assert runner.products.layout(1) == runner.products.layout(500) == layout
    assert runner.products_described == ProductPlan.fixed(layout).describe()
    seq = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = pair.target(seq).logits[0]
    for k in (1, 2, 3, 8, 20):
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


def test_plan_maps_each_row_count_to_the_layout_measured_at_or_above_it():
    plan = ProductPlan((1, 2, 4, 8), (F_LINEAR, F_LINEAR, PACKED, SMALL))
    assert [plan.layout(n) for n in (1, 2, 3, 4, 5, 8, 9, 1000)] == [
        F_LINEAR, F_LINEAR, PACKED, PACKED, SMALL, SMALL, SMALL, SMALL]
    assert plan.describe() == "rows 1-2 F.linear, 3-4 oneDNN packed, 5+ treespark.kernels.linear"
    assert ProductPlan.fixed(PACKED).describe() == "all rows oneDNN packed"
    assert ProductPlan((1, 4), (SMALL, SMALL)).describe() == "all rows treespark.kernels.linear"
    assert ProductPlan((3, 4, 8), (F_LINEAR, PACKED, F_LINEAR)).describe() == (
        "rows 1-3 F.linear, 4 oneDNN packed, 5+ F.linear")


def test_plan_refuses_malformed_plans():
    with pytest.raises(ValueError, match="one layout per row count"):
        ProductPlan((1, 2), (F_LINEAR,))
    with pytest.raises(ValueError, match="increasing"):
        ProductPlan((2, 1), (F_LINEAR, SMALL))
    with pytest.raises(ValueError, match="unknown product layouts"):
        ProductPlan((1,), ("cuBLAS",))


@pytest.mark.parametrize("layout", [F_LINEAR, SMALL])
def test_planned_linear_gives_f_linear_values_and_refuses_a_missing_packed_copy(layout):
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(10, 6, generator=g), torch.randn(10, generator=g), torch.randn(5, 6, generator=g)
    torch.testing.assert_close(planned_linear(x, w, b, ProductPlan.fixed(layout)), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no packed copy"):
        planned_linear(x, w, b, ProductPlan((4, 8), (layout, PACKED)))


def test_choose_plan_keeps_the_fastest_layout_per_row_count():
    ms = {1: {F_LINEAR: 29.0, SMALL: 75.0, PACKED: 45.0},
          4: {F_LINEAR: 50.0, SMALL: 77.0, PACKED: 55.0},
          8: {F_LINEAR: 67.5, SMALL: 79.0, PACKED: 54.3},
          64: {F_LINEAR: 132.7, SMALL: 176.6, PACKED: 138.9}}
    plan = choose_plan(ms)
    assert plan.rows == (1, 4, 8, 64)
    assert plan.layouts == (F_LINEAR, F_LINEAR, PACKED, F_LINEAR)
    # a near-tie goes to F.linear: 3 % faster is within the 5 % margin, 7 % is not
    assert choose_plan({2: {F_LINEAR: 100.0, SMALL: 97.0}}).layouts == (F_LINEAR,)
    assert choose_plan({2: {F_LINEAR: 100.0, SMALL: 93.0}}).layouts == (SMALL,)
    assert choose_plan({2: {F_LINEAR: 100.0, SMALL: 97.0}}, margin=0.0).layouts == (SMALL,)
    # W x at one row only where it is timed faster
    assert choose_plan({1: {F_LINEAR: 92.0, MATVEC: 75.0, PACKED: 120.0},
                        4: {F_LINEAR: 60.0, PACKED: 50.0}}).layouts == (MATVEC, PACKED)
    assert choose_plan({1: {F_LINEAR: 92.0, MATVEC: 90.0}}).layouts == (F_LINEAR,)
    # native float32 over its bfloat16 copies (the same values, half the bytes) only by the margin
    assert choose_plan({3: {F_LINEAR: 90.0, NATIVE: 20.0, HALF: 21.0}}).layouts == (HALF,)
    assert choose_plan({3: {F_LINEAR: 90.0, NATIVE: 18.0, HALF: 21.0}}).layouts == (NATIVE,)


def test_choose_plan_keeps_a_native_layout_unless_another_is_clearly_faster():
    # the default target's float32 timings on the AVX-512 Xeon: F.linear and oneDNN tie the
    # native kernel's products, and the native layout also runs the layer stack as one call
    ms = {1: {F_LINEAR: 18.5, MATVEC: 18.1, PACKED: 22.3, NATIVE: 17.7},
          3: {F_LINEAR: 21.3, PACKED: 25.3, NATIVE: 21.5},
          8: {F_LINEAR: 40.6, PACKED: 29.2, NATIVE: 30.9},
          16: {F_LINEAR: 39.6, PACKED: 35.0, NATIVE: 47.3},
          32: {F_LINEAR: 49.3, PACKED: 46.3}}
    assert choose_plan(ms).layouts == (NATIVE, NATIVE, NATIVE, PACKED, PACKED)
    # within the native margin of the fastest, and not past it
    assert choose_plan({4: {F_LINEAR: 100.0, HALF: 124.0}}).layouts == (HALF,)
    assert choose_plan({4: {F_LINEAR: 100.0, HALF: 126.0}}).layouts == (F_LINEAR,)
    assert choose_plan({4: {F_LINEAR: 100.0, HALF: 124.0}}, native_margin=0.0).layouts == (F_LINEAR,)


def test_plan_sample_takes_whole_layers_up_to_the_budget_and_the_head():
    layer = [torch.zeros(8, 4), torch.zeros(4, 8)]  # 2 weights of 128 bytes a layer
    head = torch.zeros(16, 4)
    ws = layer * 5 + [head]
    assert plan_sample(ws, per_layer=2, budget=300) == [0, 1, 2, 3, 10]
    assert plan_sample(ws, per_layer=2, budget=10**9) == list(range(11))
    assert plan_sample(layer * 3, per_layer=2, budget=1) == [0, 1]


@needs_onednn
def test_measure_plan_times_every_layout_at_every_row_count_and_keeps_the_fastest():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(48, 32, generator=g).to(torch.bfloat16).float(), torch.randn(32, 48, generator=g)]
    past = NATIVE_ROWS + 1
    plan, ms = measure_plan(ws, [pack(w) for w in ws], rows=(1, 3, past), reps=1,
                            halves=[to_panels(w) for w in ws])
    native = {NATIVE, HALF} if library() is not None else set()
    assert set(ms[1]) == set(LAYOUTS) - {NATIVE, HALF} | native, "every layout at one row"
    assert set(ms[3]) == set(LAYOUTS) - {MATVEC, NATIVE, HALF} | native, "W x runs one row only"
    assert set(ms[past]) == set(LAYOUTS) - {MATVEC, NATIVE, HALF}, f"native runs up to {NATIVE_ROWS} rows"
    assert all(t > 0 for by in ms.values() for t in by.values())
    assert plan == choose_plan(ms)
    unpacked, ms = measure_plan(ws, None, rows=(2,), reps=1)
    assert set(ms[2]) == {F_LINEAR, SMALL} | (native - {HALF}) and unpacked.rows == (2,)
    with pytest.raises(ValueError, match="packed weights for"):
        measure_plan(ws, [pack(ws[0])])
    with pytest.raises(ValueError, match="half weights for"):
        measure_plan(ws, halves=[to_panels(ws[0])])
    if tiled(32):   # AMX tiles take any rows: the bfloat16 copies are timed past 16
        tiles = [torch.randn(48, 32, generator=g).to(torch.bfloat16).float()]
        _, ms = measure_plan(tiles, rows=(past,), reps=1, halves=[to_panels(tiles[0])])
        assert HALF in ms[past] and NATIVE not in ms[past]


def test_runner_measures_the_plan_once_per_model_and_can_be_given_one():
    pair = random_pair(64, 3)
    first, second = TargetRunner(pair.target, (0,)), TargetRunner(pair.target, (0,))
    assert first.products is not None and first.products is second.products is product_plan(pair.target)
    fixed = ProductPlan.fixed(SMALL)
    assert TargetRunner(pair.target, (0,), products=fixed).products is fixed


def test_the_plan_is_kept_on_disk_per_machine_and_model_shape(tmp_path):
    """A second model of the same shapes on this machine reads the plan the first one
    measured (so every process multiplies alike); an unreadable file is measured again."""
    first = random_pair(64, 3).target
    plan = product_plan(first, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["layouts"] == list(plan.layouts)
    files[0].write_text(json.dumps({"rows": [1, 2], "layouts": [SMALL, F_LINEAR]}))
    assert product_plan(random_pair(64, 4).target, cache_dir=tmp_path) == ProductPlan((1, 2), (SMALL, F_LINEAR))
    files[0].write_text("{not json")
    again = product_plan(random_pair(64, 5).target, cache_dir=tmp_path)
    assert set(again.layouts) <= set(LAYOUTS)
    assert ProductPlan(**{k: tuple(v) for k, v in json.loads(files[0].read_text()).items()
                          if k in ("rows", "layouts")}) == again
    other_shape = product_plan(random_pair(96, 3).target, cache_dir=tmp_path)  # another vocabulary
    assert other_shape is not None and len(list(tmp_path.glob("*.json"))) == 2


def test_a_packed_plan_needs_packable_weights():
    pair = random_pair(64, 3)
    pair.target.to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs packed weights"):
        TargetRunner(pair.target, (0,), products=ProductPlan.fixed(PACKED))
    assert PACKED not in TargetRunner(pair.target, (0,)).products.layouts


def _runner_logits(runner: TargetRunner, seq: torch.Tensor) -> torch.Tensor:
    """The runner's logits over ``seq`` [1, n] in one causal forward."""
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
    packed_plan = ProductPlan.fixed(PACKED)  # so that the products read the packed copies
    first, second = (TargetRunner(pair.target, (0,), products=packed_plan),
                     TargetRunner(pair.target, (0,), products=packed_plan))
    assert first.weights.packed and first.weights is second.weights

    mlp = pair.target.model.layers[0].mlp
    with torch.no_grad():
        mlp.down_proj.weight.mul_(3.0)
    changed = TargetRunner(pair.target, (0,), products=packed_plan)
    assert changed.weights is not first.weights
    with torch.no_grad():
        ref = pair.target(seq).logits[0]
    torch.testing.assert_close(_runner_logits(changed, seq), ref, rtol=1e-4, atol=1e-4)

    mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(mlp.up_proj.weight))
    replaced = TargetRunner(pair.target, (0,), products=packed_plan)
    with torch.no_grad():
        ref = pair.target(seq).logits[0]
    torch.testing.assert_close(_runner_logits(replaced, seq), ref, rtol=1e-4, atol=1e-4)

"""treespark.models.precision: a target rounded to bfloat16 values is one model whichever
layout reads it (the float32 weights or their bfloat16 copies give the same logits), and
speculative decoding on it stays lossless (greedy trees equal plain decoding)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_fused_forward import _logits
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.products import halvable, model_products, product_plan
from treespark.engine.target import TargetRunner
from treespark.kernels.linear import F_LINEAR, HALF, NATIVE, ProductPlan, measure_plan
from treespark.kernels.native import is_bf16_valued, library, to_panels
from treespark.models.pair import pair_by_name, random_pair
from treespark.models.precision import (
    BF16,
    product_weights,
    round_to_bf16,
    set_precision,
)
from treespark.spec.budget import Budget
from treespark.spec.params import SamplingParams

needs_native = pytest.mark.skipif(library() is None, reason="no C compiler built treespark/kernels/gemv.c")


def test_rounding_makes_every_product_weight_a_bfloat16_value_and_nothing_else():
    model = random_pair(512, 0, family="qwen3").target
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    weights = product_weights(model)
    before = [w.detach().clone() for w in weights]
    assert not halvable(model) and not any(is_bf16_valued(w) for w in weights)
    with pytest.raises(ValueError, match="bfloat16 values"):
        model_products(model, half=True)
    assert round_to_bf16(model) == len(weights)
    assert halvable(model) and all(is_bf16_valued(w) for w in weights)
    for w, b in zip(weights, before, strict=True):
        assert torch.equal(w, b.to(torch.bfloat16).float())         # the nearest bfloat16 (ties to even)
        assert (w - b).abs().max() <= b.abs().max() * 2 ** -8        # half an ulp of 8 bits at most
    again = [w.detach().clone() for w in weights]
    round_to_bf16(model)
    assert all(torch.equal(w, a) for w, a in zip(weights, again, strict=True))   # already rounded: unchanged
    assert all(torch.equal(p, norms[n]) for n, p in model.named_parameters() if "norm" in n)


def test_a_pair_at_bfloat16_says_so_in_its_name():
    pair = pair_by_name("random", vocab_size=64, precision=BF16)
    assert pair.name.endswith("@bfloat16") and halvable(pair.target)
    assert not pair_by_name("random", vocab_size=64).name.endswith("@bfloat16")
    with pytest.raises(ValueError, match="precision"):
        set_precision(pair.target, "float16")


@needs_native
def test_the_bfloat16_copies_give_the_float32_weights_logits():
    model = random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3").target
    with pytest.raises(ValueError, match="bfloat16 copies"):
        TargetRunner(model, (0,), products=ProductPlan.fixed(HALF))
    round_to_bf16(model)
    seq = torch.randint(0, 151_936, (1, 20), generator=torch.Generator().manual_seed(0))
    half = TargetRunner(model, (0,), products=ProductPlan((8, 9), (HALF, F_LINEAR)))
    full = TargetRunner(model, (0,), products=ProductPlan((8, 9), (NATIVE, F_LINEAR)))
    assert half.weights.half and not full.weights.half
    for k in (1, 3, 8):   # the same weights, summed in another order (gemv.c's panels)
        torch.testing.assert_close(_logits(half, seq, k), _logits(full, seq, k), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        ref = model(seq).logits[0, -3:]
    torch.testing.assert_close(_logits(half, seq, 3), ref, rtol=1e-4, atol=1e-4)   # the model's own logits


@needs_native
def test_the_plan_offers_the_copies_only_to_a_rounded_model(tmp_path):
    model = random_pair(512, 0, family="qwen3").target
    plain = product_plan(model, cache_dir=tmp_path)
    assert HALF not in plain.layouts
    rounded = random_pair(512, 0, family="qwen3").target
    round_to_bf16(rounded)
    product_plan(rounded, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2           # another key: the copies among the layouts
    ws = [w.detach() for w in product_weights(rounded)][:4]
    _, timed = measure_plan(ws, rows=(1, 2), reps=1, halves=[to_panels(w) for w in ws])
    assert all(HALF in timed[n] for n in (1, 2))
    _, timed = measure_plan(ws, rows=(1,), reps=1)
    assert HALF not in timed[1]


@needs_native
def test_greedy_trees_on_a_rounded_target_read_from_its_copies_equal_plain_decoding():
    pair = random_pair(256, 1, family="qwen3")
    round_to_bf16(pair.target)
    plan = ProductPlan((8, 9), (HALF, F_LINEAR))
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        prompt = torch.randint(1, 255, (12,), generator=g).tolist()
        outs = []
        for budget in (Budget.off(), Budget(0.0, 32, 4), Budget.chain(3)):
            engine = Engine(pair, EngineConfig(max_batch_size=2, max_context=64), budget=budget, products=plan)
            engine.add_request("r", prompt, SamplingParams(max_tokens=24))
            got: list[int] = []
            while engine.has_unfinished():
                for out in engine.step():
                    got += out.new_token_ids
            outs.append(got)
        assert outs[0] == outs[1] == outs[2]

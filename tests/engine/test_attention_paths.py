"""The grouped attention path (``treespark.kernels.attention``) against the reference
gather + SDPA, through the target's forward, the drafter's block and the engine: the
same values on paged stores with shuffled blocks, rows of different lengths and padded
trees, and the same greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from treespark import Budget, random_pair
from treespark.bench.attention import draft, paged_scene, verify
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.kv import StoreShape
from treespark.engine.target import TargetRunner
from treespark.kernels import blocks
from treespark.kernels.attention import AttentionPath
from treespark.kernels.linear import F_LINEAR, ProductPlan
from treespark.spec.params import SamplingParams

LENGTHS = [37, 5, 70, 16]      # different contexts; 16: a context that ends on a block edge


@pytest.fixture(scope="module")
def pairs():
    return {"qwen3": random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3"),
            "llama": random_pair(512, 0)}


def _runners(pair):
    plan = ProductPlan.fixed(F_LINEAR)
    return {p: TargetRunner(pair.target, pair.drafter.config.target_layer_ids, plan, p) for p in AttentionPath}


def _dshape(pair):
    c = pair.drafter.config
    return StoreShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_verify_forward_is_the_reference_on_either_path(pairs, family):
    pair = pairs[family]
    runners = _runners(pair)
    out = {}
    for path, runner in runners.items():   # each path on its own copy of the same store
        scene = paged_scene(runner, _dshape(pair), LENGTHS, nodes=9, block_size=16, seed=3)
        out[path] = (verify(runner, scene), scene.kv.target.k.clone())
    (ref, ref_k), (new, new_k) = out[AttentionPath.REFERENCE], out[AttentionPath.GROUPED]
    assert ref.shape[:2] == (4, 9)
    torch.testing.assert_close(new, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_k, ref_k)            # the same tree keys written, in the same slots
    assert torch.equal(new.argmax(-1), ref.argmax(-1))


def test_bf16_verify_forward_agrees():
    pair = random_pair(512, 0)
    pair.target.to(torch.bfloat16)
    runners = _runners(pair)
    scenes = {p: paged_scene(r, _dshape(pair), LENGTHS, nodes=7, seed=4) for p, r in runners.items()}
    ref = verify(runners[AttentionPath.REFERENCE], scenes[AttentionPath.REFERENCE])
    new = verify(runners[AttentionPath.GROUPED], scenes[AttentionPath.GROUPED])
    assert new.dtype == ref.dtype == torch.float32 and torch.isfinite(new).all()
    torch.testing.assert_close(new, ref, atol=0.1 * ref.abs().max().item(), rtol=0.05)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_drafter_block_over_the_paged_context_is_the_dense_one(pairs, family, monkeypatch):
    """The dense reference's logits either way the pass runs: in one native call over the
    store itself (the block's keys and values written at each row's next positions, which
    the engine reserves; the llama pair's 16 rows) or per layer over context copies (the
    qwen3 pair's 20 rows, past the blocks' 16: the store untouched). Nothing below a row's
    context moves."""
    pair = pairs[family]
    runner = _runners(pair)[AttentionPath.GROUPED]
    blk = pair.drafter.config.block_size
    scene = paged_scene(runner, _dshape(pair), LENGTHS, nodes=blk, seed=5)
    before = scene.kv.drafter.k.clone()
    calls = []
    native_pass = blocks.layers
    monkeypatch.setattr(blocks, "layers", lambda *a, **kw: calls.append(1) or native_pass(*a, **kw))
    new = draft(pair, scene, reference=False)
    ref = draft(pair, scene, reference=True)
    assert new.shape == (4, blk, pair.drafter.config.draft_vocab)
    torch.testing.assert_close(new, ref, atol=1e-4, rtol=1e-4)
    assert len(calls) == (family == "llama" and blocks.library() is not None)
    bs, k = scene.kv.block_size, scene.kv.drafter.k
    for row, n in enumerate(LENGTHS):
        table = scene.table[row].tolist()
        ctx, ahead = ([table[p // bs] * bs + p % bs for p in ps] for ps in (range(n), range(n, n + blk)))
        assert torch.equal(k[:, ctx], before[:, ctx])
        assert torch.equal(k[:, ahead], before[:, ahead]) != bool(calls)
    copied = copy.deepcopy(pair.drafter)                 # the store's pointers stay behind
    assert copied.native._stack is None and copied.native._fused is None and copied.native._rope is None


def _greedy(pair, path, prompts):
    engine = Engine(pair, EngineConfig(max_batch_size=4, max_context=128, block_size=8, attention=path),
                    budget=Budget(0.0, 8, 3), products=ProductPlan.fixed(F_LINEAR))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=12))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_engine_output_is_the_same_on_either_path(pairs, family):
    pair = pairs[family]
    g = torch.Generator().manual_seed(7)
    vocab = pair.target.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 21, 40)]
    ref = _greedy(pair, AttentionPath.REFERENCE, prompts)
    assert all(len(t) == 12 for t in ref.values())
    assert _greedy(pair, AttentionPath.GROUPED, prompts) == ref

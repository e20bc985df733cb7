"""The target's fused forward (q|k|v and gate|up stacked, one-op norms and rope) gives
transformers' logits, on Llama, Qwen3 (q/k norms) and Qwen2 (q/k/v biases); its stacked
weights are the model's own parameters, not copies; and its norm and rope are
transformers' maths to the bit."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from treespark import random_pair
from treespark.engine.kv import KVStore
from treespark.engine.products import model_products
from treespark.engine.target import TargetRunner
from treespark.kernels.layer_ops import rms_norm, rope, rope_sign
from treespark.kernels.linear import F_LINEAR, PACKED, SMALL, ProductPlan, can_pack


def _perturb_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """random_pair's norms are all ones and it has no biases: make both matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.3 * torch.randn(p.shape, generator=g))


def _qwen2(vocab: int = 96) -> torch.nn.Module:
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model


def _target(family: str) -> torch.nn.Module:
    if family == "qwen2":
        model = _qwen2()
    elif family == "qwen3":
        model = random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3").target
    else:
        model = random_pair(512, 0).target
    _perturb_norms_and_biases(model, 1)
    return model


def _logits(runner: TargetRunner, seq: torch.Tensor, k: int) -> torch.Tensor:
    """The runner's logits at the last ``k`` tokens of ``seq`` [1, n]: the prefix in one
    forward, then the ``k`` tokens in a second (a verify forward's shape)."""
    n = seq.shape[1]
    n0 = n - k
    store = KVStore(runner.store_shape, 1, n, torch.device("cpu"), torch.float32)
    pos = torch.arange(n0)[None]
    runner.forward(seq[:, :n0], pos, pos, store, slice(0, 1), torch.ones(n0, n0, dtype=torch.bool).tril()[None, None])
    pos = torch.arange(n0, n)[None]
    mask = torch.ones(k, n, dtype=torch.bool).tril(n0)[None, None]
    return runner.forward(seq[:, n0:], pos, pos, store, slice(0, 1), mask).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_fused_and_reference_forwards_give_the_models_logits(family):
    model = _target(family)
    vocab = model.config.vocab_size
    seq = torch.randint(0, vocab, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(seq).logits[0]
    layouts = [F_LINEAR, SMALL] + ([PACKED] if can_pack(model.lm_head.weight) and family != "qwen3" else [])
    for layout in layouts:
        plan = ProductPlan.fixed(layout)
        for fused in (True, False):
            runner = TargetRunner(model, (0,), products=plan, fused=fused)
            assert len(runner.weights.layers[0].qkv) == (1 if fused else 3)
            for k in (1, 6):
                torch.testing.assert_close(_logits(runner, seq, k), ref[-k:], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, f=fused, la=layout, kk=k: f"fused={f} {la} k={kk}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_compiled_forward_gives_the_models_logits(family):
    """torch.compile'd norms, rotation and activation: transformers' logits to float rounding
    (inductor may order a reduction differently), over a prefix forward and a verify one."""
    model = _target(family)
    seq = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(seq).logits[0]
    runner = TargetRunner(model, (0,), products=ProductPlan.fixed(F_LINEAR), compile_backend="inductor")
    assert runner.ops.backend == "inductor"
    for k in (1, 6):
        torch.testing.assert_close(_logits(runner, seq, k), ref[-k:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="fused"):
        TargetRunner(model, (0,), products=ProductPlan.fixed(F_LINEAR), fused=False, compile_backend="inductor")


def test_stacked_weights_are_the_models_parameters_not_copies():
    """The first fused runner makes q/k/v (and gate/up, and Qwen2's biases) views of one
    stacked tensor: the model's own forward is unchanged, the memory did not grow, and a
    second runner stacks nothing."""
    model = _qwen2()
    seq = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(seq).logits
    names = [n for n, _ in model.named_parameters()]
    first = TargetRunner(model, (0,), products=ProductPlan.fixed(F_LINEAR))
    assert [n for n, _ in model.named_parameters()] == names
    with torch.no_grad():
        assert torch.equal(model(seq).logits, before)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv, gate_up = first.weights.layers[1].qkv[0], first.weights.layers[1].gate_up[0]
    assert qkv.weight.shape == (64 + 2 * 32, 64) and qkv.bias.shape == (128,)
    for stacked, parts in ((qkv.weight, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                           (qkv.bias, [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
                           (gate_up.weight, [mlp.gate_proj.weight, mlp.up_proj.weight])):
        assert all(p.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() for p in parts)
        assert torch.equal(torch.cat([p.detach() for p in parts]), stacked)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    second = TargetRunner(model, (0,), products=ProductPlan.fixed(F_LINEAR))
    assert second.weights is first.weights


def test_a_changed_or_replaced_weight_is_seen_by_the_next_runner():
    model = _qwen2()
    _perturb_norms_and_biases(model, 4)
    seq = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    first = TargetRunner(model, (0,), products=ProductPlan.fixed(F_LINEAR))
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.mul_(3.0)   # in place: the stacked tensor is the same memory
        attn.q_proj.bias.add_(1.0)
    changed = TargetRunner(model, (0,), products=ProductPlan.fixed(F_LINEAR))
    assert changed.weights.layers[0].qkv[0].weight.data_ptr() == first.weights.layers[0].qkv[0].weight.data_ptr()
    with torch.no_grad():
        ref = model(seq).logits[0]
    torch.testing.assert_close(_logits(changed, seq, 3), ref[-3:], rtol=1e-4, atol=1e-4)

    attn.v_proj.weight = torch.nn.Parameter(torch.randn_like(attn.v_proj.weight))   # replaced: stacked again
    model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(
        model.model.layers[1].mlp.up_proj.weight))
    replaced = TargetRunner(model, (0,), products=ProductPlan.fixed(F_LINEAR))
    with torch.no_grad():
        ref = model(seq).logits[0]
    torch.testing.assert_close(_logits(replaced, seq, 3), ref[-3:], rtol=1e-4, atol=1e-4)
    assert attn.v_proj.weight.untyped_storage().data_ptr() == (
        replaced.weights.layers[0].qkv[0].weight.untyped_storage().data_ptr())


@pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="no oneDNN")
def test_packed_copies_follow_the_stacked_weights():
    model = _qwen2()
    packed = model_products(model, packed=True)
    assert packed.packed and packed.layers[0].qkv[0].packed.out_features == 128
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.mul_(2.0)
    assert model_products(model, packed=True) is not packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_to_the_bit(dtype):
    """One weight over the last dim, and per-head weights (Qwen3's q and k norms in one call)."""
    g = torch.Generator().manual_seed(0)
    norms = [LlamaRMSNorm(48, eps=1e-5).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(1 + torch.randn(48, generator=g))
        x = (3 * torch.randn(5, 7, 48, generator=g)).to(dtype)                 # [N, H, D]
        assert torch.equal(rms_norm(x, norms[0].weight, 1e-5), norms[0](x))
        per_head = torch.cat([norms[0].weight.expand(3, 48), norms[1].weight.expand(4, 48)])   # [H, D]
        assert torch.equal(rms_norm(x, per_head, 1e-5), torch.cat([norms[0](x[:, :3]), norms[1](x[:, 3:])], 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_transformers_to_the_bit(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 16, generator=g).to(dtype).transpose(1, 2)   # [B, H, K, D], strided as ours
    k = torch.randn(2, 2, 3, 16, generator=g).to(dtype)
    angles = torch.rand(2, 3, 8, generator=g) * 6
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)          # unsqueezes at dim 1
    signed = sin[:, None] * rope_sign(16, q.device, dtype)
    assert torch.equal(rope(q, cos[:, None], signed), q_ref)
    assert torch.equal(rope(k, cos[:, None], signed), k_ref)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_holds_the_models_own_cos_and_sin(fused, dtype):
    """A forward looks its positions' cos and sin up in a table made once from the
    model's rotary embedding (up to ``max_positions``): each position's values to the
    bit, whatever else the batch holds; a scaling whose values move with the batch's
    longest position (dynamic) keeps computing them."""
    target = random_pair(512, 0).target.to(dtype)
    runner = TargetRunner(target, (0,), ProductPlan.fixed(F_LINEAR), fused=fused, max_positions=300)
    assert runner._rope is not None and runner._rope[0].shape == (300, runner.head_dim)
    positions = torch.tensor([[0, 7, 299], [150, 151, 3]])
    h = torch.zeros(2, 3, target.config.hidden_size, dtype=dtype)
    cos, sin = target.model.rotary_emb(h, positions)
    want = cos[:, None].to(dtype), sin[:, None].to(dtype) * (rope_sign(runner.head_dim, h.device, dtype) if fused else 1)
    for got, ref in zip(runner._rotary(h, positions), want, strict=True):
        assert got.shape == ref.shape and torch.equal(got, ref)
    target.model.rotary_emb.rope_type = "dynamic"
    assert TargetRunner(target, (0,), ProductPlan.fixed(F_LINEAR), fused=fused)._rope is None
    target.model.rotary_emb.rope_type = "default"


@pytest.mark.parametrize("layout", [F_LINEAR, SMALL])
def test_logits_into_a_kept_buffer_are_the_same_bits(layout):
    """``logits_into``: where the plan runs the head as ``F.linear`` the logits are written
    into the caller's memory, the same values to the bit; any other layout ignores it."""
    runner = TargetRunner(_target("llama"), (0,), ProductPlan.fixed(layout))
    seq = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    store = KVStore(runner.store_shape, 1, 12, torch.device("cpu"), torch.float32)
    pos = torch.arange(12)[None]
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    fresh = runner.forward(seq, pos, pos, store, slice(0, 1), mask).logits
    buf = torch.full((20 * 512,), float("nan"))
    kept = runner.forward(seq, pos, pos, store, slice(0, 1), mask, logits_into=buf).logits
    assert torch.equal(kept, fresh)
    assert (kept.data_ptr() == buf.data_ptr()) == (layout == F_LINEAR)
    assert torch.isnan(buf[12 * 512:]).all()   # nothing past the logits written

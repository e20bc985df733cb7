"""Layer f: a state dict in the public DSpark layout loads strictly and round-trips.

The loader's rules (vLLM's) for the other public shapes are in test_checkpoint.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from treespark.kernels.attention import DenseKV
from treespark.models.checkpoint import DrafterCheckpointError, load_drafter, save_drafter
from treespark.models.drafter_config import DSparkConfig

# A public-style config (deepseek-ai/dspark_qwen3_4b_block7 shape, scaled down).
CONFIG = {
    "architectures": ["DSparkDraftModel"], "model_type": "qwen3",
    "vocab_size": 101, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
    "block_size": 7, "target_layer_ids": [1, 9, 17], "mask_token_id": 100, "markov_rank": 16,
    "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
}


def expected_layout(c: dict, confidence: bool) -> dict[str, tuple[int, ...]]:
    """Key -> shape, written from the public layout's names (not from our module)."""
    h, i, v, r = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["markov_rank"]
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    keys = {"embed_tokens.weight": (v, h), "fc.weight": (h, len(c["target_layer_ids"]) * h),
            "hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (v, h),
            "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
    for n in range(c["num_hidden_layers"]):
        p = f"layers.{n}."
        keys |= {p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
                 p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                 p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                 p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                 p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                 p + "post_attention_layernorm.weight": (h,)}
    if confidence:
        keys |= {"confidence_head.proj.weight": (1, h + r), "confidence_head.proj.bias": (1,)}
    return keys


def write_checkpoint(path, confidence: bool, extra: dict | None = None):
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in expected_layout(CONFIG, confidence).items()}
    state |= extra or {}
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return state


@pytest.mark.parametrize("confidence", [False, True])
def test_public_layout_loads_strictly_and_round_trips(tmp_path, confidence):
    state = write_checkpoint(tmp_path / "ckpt", confidence)
    drafter = load_drafter(tmp_path / "ckpt")
    assert drafter.config.block_size == 7 and drafter.config.target_layer_ids == (1, 9, 17)
    ours = drafter.state_dict()
    assert set(ours) == set(state)
    for k, v in state.items():
        assert torch.equal(ours[k], v), k
    save_drafter(drafter, tmp_path / "again", dtype=None)  # as they are: the round trip is exact
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)
    reloaded = load_drafter(tmp_path / "again")
    assert reloaded.config == drafter.config


def test_layout_is_the_modules_own():
    ours = {k: tuple(v.shape) for k, v in
            __import__("treespark.models.drafter", fromlist=["DSparkDrafter"]).DSparkDrafter(
                DSparkConfig.from_dict(CONFIG)).state_dict().items()}
    assert ours == expected_layout(CONFIG, confidence=False)


def test_unexpected_or_missing_keys_are_errors(tmp_path):
    write_checkpoint(tmp_path / "extra", False, {"surprise.weight": torch.zeros(2)})
    with pytest.raises(DrafterCheckpointError, match="unexpected tensors: surprise.weight"):
        load_drafter(tmp_path / "extra")
    state = write_checkpoint(tmp_path / "missing", False)
    del state["fc.weight"]
    save_file(state, str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(DrafterCheckpointError, match="missing tensors: fc.weight"):
        load_drafter(tmp_path / "missing")
    with pytest.raises(DrafterCheckpointError, match="no drafter checkpoint directory"):
        load_drafter(tmp_path / "nowhere")


def test_block_logits_shape(tmp_path):
    write_checkpoint(tmp_path / "ckpt", False)
    d = load_drafter(tmp_path / "ckpt")
    b, c = 2, 5
    k = torch.zeros(2, b, 2, c, 8)
    u = d.block_logits(torch.tensor([3, 4]), DenseKV(k, k.clone()), torch.tensor([5, 2]))
    assert u.shape == (b, 7, 101) and torch.isfinite(u).all()


def test_checkpoint_is_assigned_never_materialised_twice(tmp_path):
    """The drafter is built on the meta device and the checkpoint's tensors are assigned:
    every tensor ends on the asked device and dtype, holding the checkpoint's values."""
    state = write_checkpoint(tmp_path / "ckpt", confidence=False)
    drafter = load_drafter(tmp_path / "ckpt", dtype=torch.bfloat16)
    tensors = dict(drafter.named_parameters()) | dict(drafter.named_buffers())
    assert not any(t.is_meta for t in tensors.values())
    assert all(t.dtype == torch.bfloat16 for t in drafter.parameters())
    assert torch.equal(drafter.fc.weight, state["fc.weight"].to(torch.bfloat16))
    # and it runs: the rotary frequencies were built for real, in float32
    assert drafter.rotary._inv_freq[torch.device("cpu")].dtype == torch.float32
    ctx_k = torch.zeros(2, 1, 2, 3, 8, dtype=torch.bfloat16)
    out = drafter.block_logits(torch.tensor([5]), DenseKV(ctx_k, ctx_k.clone()), torch.tensor([3]))
    assert out.shape == (1, 7, 101) and torch.isfinite(out).all()


def _cos(config: dict, positions: list[int]) -> torch.Tensor:
    from treespark.models.rotary import Rotary

    cos, _ = Rotary(DSparkConfig.from_dict(config))(torch.tensor([positions]), torch.float32)
    return cos[0]


def test_rope_scaling_comes_from_the_config():
    """Linear scaling by 2 puts position 2p where the unscaled rope puts p; the
    transformers-5 form (rope_parameters) reads the same as the older rope_scaling."""
    plain = _cos(CONFIG, [0, 3, 7, 20])
    linear_old = _cos(CONFIG | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, [0, 6, 14, 40])
    linear_new = _cos(CONFIG | {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 1000000}}, [0, 6, 14, 40])
    assert torch.allclose(plain, linear_old, atol=1e-5) and torch.allclose(plain, linear_new, atol=1e-5)
    yarn = CONFIG | {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    assert not torch.allclose(_cos(yarn, [0, 6, 14, 40]), _cos(CONFIG, [0, 6, 14, 40]))
    with pytest.raises(ValueError, match="dynamic"):
        _cos(CONFIG | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, [0])


@pytest.mark.parametrize("shared", [False, True])
def test_grown_drafter_drafts_what_it_grew_from_and_trains(shared):
    from treespark import random_pair
    from treespark.models.drafter import grown

    pair = random_pair(64, 0, draft_vocab=48 if shared else 0)
    d = pair.drafter
    if shared:   # a shared-embedding drafter, as the default pair's
        cfg = DSparkConfig(**{**d.config.__dict__, "shared_embeddings": True})
        from treespark.models.drafter import DSparkDrafter, attach_from_target
        d = DSparkDrafter(cfg)
        attach_from_target(d, pair.target)
    g = grown(d, 3)
    assert g.config.num_hidden_layers == 3 and len(g.layers) == 3
    gen = torch.Generator().manual_seed(1)
    taps = torch.randn(12, d.config.context_size, generator=gen)
    tokens = torch.randint(0, 64, (12,), generator=gen)
    anchors = torch.tensor([2, 5, 7])
    torch.testing.assert_close(g.train_logits(taps, tokens, anchors), d.train_logits(taps, tokens, anchors))
    k1, v1 = d.context_kv(taps[None], torch.arange(12)[None])
    k3, v3 = g.context_kv(taps[None], torch.arange(12)[None])
    assert k3.shape[0] == 3
    torch.testing.assert_close(g.block_logits(tokens[:1], DenseKV(k3, v3), torch.tensor([12])),
                               d.block_logits(tokens[:1], DenseKV(k1, v1), torch.tensor([12])))
    g.train_logits(taps, tokens, anchors).logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in g.named_parameters() if n.startswith("layers.2.")}
    assert grads["layers.2.self_attn.o_proj.weight"].abs().sum() > 0
    assert grads["layers.2.mlp.down_proj.weight"].abs().sum() > 0
    with pytest.raises(ValueError, match="cannot grow"):
        grown(g, 2)

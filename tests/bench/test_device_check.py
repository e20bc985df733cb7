"""The device check's CPU mode runs in the suite: every section, and it fails when it should."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from treespark.bench.device_check import device_check
from treespark.bench.device_correctness import disagreement_margin
from treespark.bench.device_pair import TINY, CheckConfig, Forward, build_pair

SECTIONS = ("## Preflight", "## Launches per step", "## Correctness", "## Throughput", "## Long context", "## The floor")


def test_meta_built_pair_is_materialised_and_tied():
    pair = build_pair(TINY, torch.device("cpu"), torch.float32, seed=1)
    tensors = list(pair.target.parameters()) + list(pair.target.buffers()) + list(pair.drafter.parameters())
    assert not any(t.is_meta for t in tensors) and all(torch.isfinite(t).all() for t in tensors)
    assert pair.target.lm_head.weight.data_ptr() == pair.target.model.embed_tokens.weight.data_ptr()
    assert pair.vocab_size == 151_936  # the real vocabulary, at tiny widths


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-check")
    return out, device_check(CheckConfig.cpu(), out, device="cpu", log=lambda m: None)


def test_cpu_mode_passes_and_reports_every_section(cpu_run):
    out, result = cpu_run
    assert result["ok"], [c for c in result["checks"] if not c["ok"]]
    text = (out / "device-check.md").read_text()
    assert all(s in text for s in SECTIONS) and "PASSED" in text
    assert json.loads((out / "device-check.json").read_text())["ok"] is True
    names = {c["check"] for c in result["checks"]}
    assert any("greedy tree of 32" in n for n in names) and any("loader" in n for n in names)
    assert "keyed noise and draws: device = CPU, bit for bit" in names
    cfg = CheckConfig.cpu()
    rows = result["throughput"]
    assert len(rows) == len(cfg.temperatures) * len(cfg.batch_sizes) * 4  # plain, chain, tree, served
    assert all(r["tokens_per_s"] > 0 and r["verify"] > 0 for r in rows)
    assert result["long_context"] and result["floor"]["floor_s"] > 0
    # one step profiled per policy: a tree step runs one target forward, as plain decoding does,
    # and more operators around it (the drafter, the walk)
    plain, tree = result["launches"]["plain"], result["launches"]["tree of 32"]
    assert plain["forwards"] == tree["forwards"] == 1 and 0 < plain["per_forward"] <= plain["per_step"]
    assert plain["drafts"] == 0 and tree["drafts"] == 1 and 0 < tree["per_draft"] < tree["per_step"]
    assert tree["per_step"] > plain["per_step"] and tree["unit"] == "operators called"
    # the greedy trees equal plain decoding in float32, token for token
    assert all(g["matched"] == g["of"] for g in result["greedy"].values())


def _fails(tmp_path, inject) -> dict:
    # every section, at the smallest sizes: the correctness checks are what is tested here
    cfg = replace(CheckConfig.cpu(), batch_sizes=(1,), temperatures=(0.0,), timed_steps=1, warm_steps=0,
                  greedy_prompts=1, greedy_tokens=4, long_context=((1, 32),), policy_profile_s=0.5)
    result = device_check(cfg, tmp_path, device="cpu", log=lambda m: None, inject=inject)
    assert not result["ok"] and "FAILED" in (tmp_path / "device-check.md").read_text()
    return {c["check"] for c in result["checks"] if not c["ok"]}


def test_a_wrong_logit_fails_the_check(tmp_path):
    def wrong(name, t):
        if name == "runner_logits":
            t = t.clone()
            t[0, 5, 7] = t[0, 5].max() + 50.0   # one position's argmax moved
        return t

    failed = _fails(tmp_path, wrong)
    assert any("argmax agreement" in n for n in failed) and any("max |logit diff|" in n for n in failed)


def test_a_nan_fails_the_check(tmp_path):
    def nan(name, t):
        if name == "drafter_logits":
            t = t.clone()
            t[0, 1, 3] = float("nan")
        return t

    assert any("finite" in n for n in _fails(tmp_path, nan))


def test_the_cli_exits_non_zero_when_a_check_fails(tmp_path, monkeypatch):
    import treespark.bench.device_check as dc
    from treespark.cli import main

    monkeypatch.setattr(dc, "device_check", lambda *a, **k: {"ok": False, "errors": {}, "checks": [
        {"check": "runner vs transformers: argmax agreement", "ok": False}]})
    with pytest.raises(SystemExit) as e:
        main(["device-check", "--device", "cpu", "--out", str(tmp_path)])
    assert "argmax agreement" in str(e.value.code)


def test_a_section_that_raises_fails_the_check_and_the_rest_still_run(tmp_path, monkeypatch):
    import treespark.bench.device_check as dc

    def broken(*a, **k):
        raise RuntimeError("the loader broke")

    monkeypatch.setattr(dc, "check_loader", broken)
    cfg = replace(CheckConfig.cpu(), batch_sizes=(1,), temperatures=(0.0,), timed_steps=1, warm_steps=0,
                  greedy_prompts=1, greedy_tokens=4, long_context=((1, 32),), policy_profile_s=0.5)
    result = device_check(cfg, tmp_path, device="cpu", log=lambda m: None)
    assert not result["ok"] and "the loader broke" in result["errors"]["loader"]
    assert result["throughput"] and result["long_context"] and result["floor"]  # after the failure
    text = (tmp_path / "device-check.md").read_text()
    assert "FAILED" in text and "## Error in loader" in text and "## Throughput" in text
    assert json.loads((tmp_path / "device-check.json").read_text())["errors"].keys() == {"loader"}


def test_bfloat16_and_a_graphed_forward_as_on_a_gpu_pass_on_cpu(tmp_path):
    # the GPU's dtype and the forward padded to CUDA-graph buckets (on CPU run eagerly)
    # through every section, at the smallest sizes (the eager forward's sections run in the
    # float32 tests above; compiled forwards' correctness: tests/engine/test_compiled.py)
    cfg = replace(CheckConfig.cpu(), batch_sizes=(2,), temperatures=(1.0,), timed_steps=2, warm_steps=1,
                  greedy_prompts=2, greedy_tokens=8, long_context=((1, 64),), policy_profile_s=0.5,
                  forwards=(Forward(cuda_graphs=True),))
    result = device_check(cfg, tmp_path, device="cpu", log=lambda m: None, dtype=torch.bfloat16)
    assert result["preflight"]["dtype"] == "torch.bfloat16"
    assert result["ok"], (result["errors"], [c for c in result["checks"] if not c["ok"]])
    assert {r["forward"] for r in result["throughput"]} == {"graphs"}
    names = {c["check"] for c in result["checks"]}
    assert "greedy tree of 32 = plain decoding (graphs)" in names
    assert "graphed vs eager verify forward: argmax agreement (graphs)" in names
    assert "graphed vs eager drafter block: argmax agreement (graphs)" in names
    assert set(result["launches"]) == {"plain, graphs", "tree of 32, graphs"}
    assert all(x["captures"] == 0 for x in result["launches"].values())  # nothing is captured on CPU
    assert "forward | T | batch" in (tmp_path / "device-check.md").read_text()


def test_a_flipped_argmax_is_measured_by_the_reference_margin():
    ref = torch.tensor([[[1.0, 0.9, 0.0], [0.0, 2.0, 1.0]]])
    assert disagreement_margin(ref, ref.clone()) == 0.0
    got = torch.tensor([[[0.8, 0.95, 0.0], [0.0, 2.0, 1.0]]])   # row 0 flips to token 1
    assert abs(disagreement_margin(ref, got) - 0.1) < 1e-6
    got[0, 1] = torch.tensor([0.0, 0.0, 3.0])                  # and row 1 to token 2, 1.0 from the top
    assert abs(disagreement_margin(ref, got) - 1.0) < 1e-6

"""The one-shot device check runs end to end (here on CPU, with the tiny shape)."""

from __future__ import annotations

import torch

from treespark.bench.device_check import TINY, CheckConfig, build_pair, device_check
from treespark.engine.cost_measure import MeasureConfig
from treespark.pricing.costmodel import CostModel


def test_meta_built_pair_is_materialised_and_tied():
    pair = build_pair(TINY, torch.device("cpu"), torch.float32, seed=1)
    tensors = list(pair.target.parameters()) + list(pair.target.buffers()) + list(pair.drafter.parameters())
    assert not any(t.is_meta for t in tensors) and all(torch.isfinite(t).all() for t in tensors)
    assert pair.target.lm_head.weight.data_ptr() == pair.target.model.embed_tokens.weight.data_ptr()


def test_device_check_writes_tables_and_cost_model(tmp_path):
    cfg = CheckConfig(shape=TINY, batch_sizes=(1, 2), prompt_len=8, new_tokens=6,
                      cost_grid=MeasureConfig(batch_sizes=(1, 2), tokens=(1, 2, 4), context=16, repeats=1))
    text = device_check(cfg, tmp_path, device="cpu", log=lambda m: None)
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert len(rows) == 2 * 2 * 3  # temperatures x batch sizes x policies
    assert (tmp_path / "device-check.md").read_text() == text
    cost = CostModel.load(tmp_path / "costmodel.json")
    assert cost.time(2, 4) > 0

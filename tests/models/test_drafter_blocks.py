"""The drafter's block pass on the native blocks (``treespark.models.drafter_blocks``): the
torch layers' values, where it runs and where it does not, its stacked weights kept in
step with the parameters; and the shared head's bfloat16 copy."""

from __future__ import annotations

import pytest
import torch

from treespark import random_pair
from treespark.kernels import blocks
from treespark.kernels.attention import DenseKV
from treespark.kernels.native import MAX_ROWS, library
from treespark.models.drafter import DSparkDrafter, attach_from_target
from treespark.models.drafter_blocks import NativeBlockPass
from treespark.models.drafter_config import DSparkConfig

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the native kernels are not built")


def _drafter(layers: int = 2, block: int = 5) -> DSparkDrafter:
    pair = random_pair(151_936, 0, block_size=block, draft_vocab=512)
    d = pair.drafter
    cfg = DSparkConfig(**{**d.config.__dict__, "num_hidden_layers": layers, "shared_embeddings": True})
    out = DSparkDrafter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        out.d2t.copy_(d.d2t)
    attach_from_target(out, pair.target)
    return out.eval()


def _context(d: DSparkDrafter, b: int, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    taps = torch.randn(b, c, d.config.context_size, generator=gen)
    k, v = d.context_kv(taps, torch.arange(c).expand(b, c))
    return k, v, torch.tensor([c - 3 * i for i in range(b)])


def _counting(monkeypatch, *names: str) -> list[int]:
    calls = [0]
    for name in names or ("attn_in", "attn_out_mlp"):
        fn = getattr(blocks, name)

        def counted(*args, _fn=fn, **kwargs):
            calls[0] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(blocks, name, counted)
    return calls


@pytest.mark.parametrize("b", [1, 3])
def test_the_native_block_pass_gives_the_torch_layers_logits(b, monkeypatch):
    d = _drafter()
    k, v, lengths = _context(d, b, 24)
    anchors = torch.arange(b) + 7
    assert b * d.config.block_size <= MAX_ROWS
    calls = _counting(monkeypatch)
    native = d.block_logits(anchors, DenseKV(k, v), lengths)
    assert calls[0] == 2 * d.config.num_hidden_layers          # two calls a layer: it ran there
    monkeypatch.setattr(NativeBlockPass, "runs", lambda self, x: False)
    torch_layers = d.block_logits(anchors, DenseKV(k, v), lengths)
    assert calls[0] == 2 * d.config.num_hidden_layers
    torch.testing.assert_close(native, torch_layers, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_the_native_context_is_the_torch_layers_keys_and_values(stored, monkeypatch):
    """Every layer's context keys and values in one ``attn_in`` call (no query heads, each
    layer's k and v stacked; exact bfloat16 panels for a drafter stored in bfloat16) are
    the torch layers' to float rounding, at a few rows; at a prefill's many rows too: the
    native norm and rotation around torch's product where the weights are float32 (the
    torch layers where they are panels this CPU cannot take at that many rows)."""
    d = _drafter(layers=3)
    if stored == "bfloat16":
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(p.bfloat16().float())
    gen = torch.Generator().manual_seed(5)
    taps = torch.randn(1, 7, d.config.context_size, generator=gen)
    positions = torch.tensor([[40, 41, 43, 44, 47, 48, 52]])
    calls = _counting(monkeypatch)
    k, v = d.context_kv(taps, positions)
    assert calls[0] == 1 and d.native._made(d.layers)[4].half == (stored == "bfloat16")
    ref_k, ref_v = d.context_kv_train(taps, positions)
    assert k.shape == ref_k.shape == (3, 1, d.config.num_key_value_heads, 7, d.config.head_dim)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, ref_v, rtol=1e-4, atol=1e-4)
    many = torch.randn(1, 3 * MAX_ROWS, d.config.context_size, generator=gen)
    at = torch.arange(3 * MAX_ROWS)[None] + 5
    rotations = _counting(monkeypatch, "qk_rope")
    k, v = d.context_kv(many, at)
    one_call = d.native._in_one_call(d.native._made(d.layers)[4], 3 * MAX_ROWS)   # (bfloat16 panels as AMX tiles: up to 64 rows)
    assert calls[0] == 1 + one_call and rotations[0] == (not one_call and stored == "float32")
    ref_k, ref_v = d.context_kv_train(many, at)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, ref_v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_a_commits_context_is_written_in_one_call_as_the_torch_layers_make_it(stored, monkeypatch):
    """``write_context`` at a commit's few rows: one native call (``blocks.context_write``)
    writes every layer's keys and values at the rows' slots, the torch layers' to float
    rounding, and nothing else; a position past the rotary tables grows them (the write
    is the same); at rows no one call takes, the reference path writes them."""
    d = _drafter(layers=3)
    if stored == "bfloat16":
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(p.bfloat16().float())
    c = d.config
    gen = torch.Generator().manual_seed(6)
    store_k = torch.randn(3, 64, c.num_key_value_heads, c.head_dim, generator=gen)
    store_v = torch.randn(store_k.shape, generator=gen)
    for n, first in ((3, 40), (5, 3000)):            # 3000: past the first tables (1,024 positions)
        taps = torch.randn(n, c.context_size, generator=gen)
        positions = torch.arange(n) * 2 + first
        slots = torch.randperm(64, generator=gen)[:n]
        k0, v0 = store_k.clone(), store_v.clone()
        writes, torch_path = _counting(monkeypatch, "context_write"), _counting(monkeypatch, "attn_in")
        d.write_context(taps, positions, store_k, store_v, slots)
        assert writes[0] == (1 if first < 1024 else 2) and torch_path[0] == 0   # (past the tables: again, grown)
        ref_k, ref_v = d.context_kv_train(taps[None], positions[None])       # [L, 1, kvh, n, hd]
        torch.testing.assert_close(store_k[:, slots], ref_k[:, 0].transpose(1, 2), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(store_v[:, slots], ref_v[:, 0].transpose(1, 2), rtol=1e-4, atol=1e-4)
        others = torch.ones(64, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(store_k[:, others], k0[:, others]) and torch.equal(store_v[:, others], v0[:, others])
    assert d.native.rope_tables(d.rotary, 0)[0].shape[0] >= 3009
    many = 3 * blocks.TILE_ROWS
    taps = torch.randn(many, c.context_size, generator=gen)
    store_k = torch.zeros(3, many, c.num_key_value_heads, c.head_dim)
    store_v = torch.zeros_like(store_k)
    calls = _counting(monkeypatch, "context_write")
    d.write_context(taps, torch.arange(many), store_k, store_v, torch.arange(many))
    assert calls[0] == 0
    ref_k, _ = d.context_kv_train(taps[None], torch.arange(many)[None])
    torch.testing.assert_close(store_k, ref_k[:, 0].transpose(1, 2), rtol=1e-4, atol=1e-4)


def test_rows_past_the_kernels_and_training_run_the_torch_layers(monkeypatch):
    d = _drafter()
    b = MAX_ROWS // d.config.block_size + 1
    k, v, lengths = _context(d, b, 24)
    calls = _counting(monkeypatch)
    d.block_logits(torch.arange(b), DenseKV(k, v), lengths)
    x = torch.zeros(1, d.config.block_size, d.config.hidden_size)
    with torch.enable_grad():
        assert not d.native.runs(x)
    assert calls[0] == 0


def test_the_stacked_weights_follow_a_load():
    d = _drafter()
    k, v, lengths = _context(d, 1, 16)
    before = d.block_logits(torch.tensor([5]), DenseKV(k, v), lengths)
    state = {n: t.clone() for n, t in d.state_dict().items()}
    state["layers.0.mlp.up_proj.weight"] *= 2
    d.load_state_dict(state)
    after = d.block_logits(torch.tensor([5]), DenseKV(k, v), lengths)
    with torch.no_grad():
        fused, _ = d.native.fused_layers(d.layers)[0]
    assert torch.equal(fused.wgu[d.config.intermediate_size:], d.layers[0].mlp.up_proj.weight)
    assert not torch.allclose(before, after)


def test_the_shared_head_reads_a_bfloat16_copy_only_where_it_holds_its_values():
    d = _drafter()
    assert d._shared_head_half is None                           # float32 values: no copy
    pair = random_pair(151_936, 0, block_size=5, draft_vocab=512)
    head = pair.target.get_output_embeddings().weight.detach().bfloat16().float()
    d.attach_target_embeddings(pair.target.get_input_embeddings().weight.detach(), head)
    assert d._shared_head_half is not None and d._shared_head_half.dtype == torch.bfloat16
    h = torch.randn(5, d.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(d.head(h), h @ d._shared_head.T, rtol=1e-5, atol=1e-4)


def test_a_drafter_stored_in_bfloat16_drafts_on_panels(monkeypatch):
    """Weights of bfloat16 values (the shipped drafter's): the block pass's four products
    read exact bfloat16 panels, and its logits are the float32 products' to float rounding."""
    from treespark.kernels import linear as linear_module

    d = _drafter()
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.bfloat16().float())
    fused, half = d.native.fused_layers(d.layers)[0]
    assert half and fused.wqkv.dtype == fused.wo.dtype == fused.wgu.dtype == fused.wdown.dtype == torch.bfloat16
    k, v, lengths = _context(d, 2, 24)
    anchors = torch.tensor([3, 9])
    panels = d.block_logits(anchors, DenseKV(k, v), lengths)
    monkeypatch.setattr(NativeBlockPass, "runs", lambda self, x: False)
    monkeypatch.setattr(linear_module, "on_native", lambda x, weight: False)
    torch.testing.assert_close(panels, d.block_logits(anchors, DenseKV(k, v), lengths), rtol=1e-4, atol=1e-4)


def test_the_head_runs_over_the_depths_asked_for_only():
    d = _drafter()
    k, v, lengths = _context(d, 2, 24)
    anchors = torch.tensor([3, 9])
    full = d.block_logits(anchors, DenseKV(k, v), lengths)
    assert full.shape[1] == d.config.block_size
    two = d.block_logits(anchors, DenseKV(k, v), lengths, 2)
    assert two.shape == (2, 2, full.shape[-1])
    torch.testing.assert_close(two, full[:, :2], rtol=1e-5, atol=1e-5)

"""The packed prefill (``treespark.engine.prefill``): a step's chunks as one row with no
padding, each chunk attending only its own request's blocks. Its host packing, and its
forward against the padded forward it replaces (rows padded to the widest chunk, every
row's keys to the longest context): the same logits, tapped states and stored keys,
on either attention path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treespark import random_pair
from treespark.engine.attend import chunk_attention
from treespark.engine.kv import PagedKV, StoreShape, blocks_for
from treespark.engine.prefill import prefill_batch
from treespark.engine.request import Request
from treespark.engine.target import TargetRunner
from treespark.kernels.attention import AttentionPath
from treespark.kernels.linear import F_LINEAR, ProductPlan
from treespark.spec.params import SamplingParams
from treespark.spec.sampling import TorchSampler


def _request(rid: str, prompt: list[int], blocks: list[int], computed: int, output: list[int] | None = None):
    req = Request(rid, prompt, SamplingParams(max_tokens=4), TorchSampler(0), None, output=list(output or []))
    req.blocks, req.computed = blocks, computed
    return req


def test_prefill_batch_packs_chunks_one_after_another():
    kv = PagedKV(StoreShape(1, 1, 2), StoreShape(1, 1, 2), num_blocks=16, block_size=4,
                 device=torch.device("cpu"), dtype=torch.float32)
    a = _request("a", list(range(100, 110)), [5, 2, 9], computed=4)                 # positions 4..9: its end
    b = _request("b", list(range(200, 207)), [7, 3], computed=0)                     # positions 0..2 of 7
    c = _request("c", [1, 2, 3], [11, 12], computed=3, output=[40, 41, 42])          # recomputed: 3..4 its end
    batch = prefill_batch([(a, 6), (b, 3), (c, 2)], kv)
    assert batch.tokens.tolist() == list(range(104, 110)) + [200, 201, 202] + [40, 41]
    assert batch.positions.tolist() == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    assert batch.slots.tolist() == [2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4, 9 * 4 + 1,
                                    7 * 4, 7 * 4 + 1, 7 * 4 + 2, 11 * 4 + 3, 12 * 4]
    assert batch.spans == ((0, 6, 4), (6, 3, 0), (9, 2, 3))
    assert batch.ends == (True, False, True)
    assert batch.firsts == (0,)             # c's first token is emitted already
    assert batch.last == [5]
    assert batch.tables.tolist() == [[5, 2, 9], [7, 0, 0], [11, 12, 0]]   # each up to its chunk's last block


def _padded(runner, kv, reqs, chunks):
    """The forward the packed one replaced: rows padded to the widest chunk, each row's
    keys to the longest context. Logits and taps [R, width, ...]."""
    starts = [r.computed for r in reqs]
    width = max(m for _, m in chunks)
    t = max(starts) + width
    tokens = np.zeros((len(chunks), width), dtype=np.int64)
    for i, (req, m) in enumerate(chunks):
        tokens[i, :m] = (req.prompt + req.output)[starts[i]:starts[i] + m]
    pos = torch.as_tensor(np.asarray(starts)[:, None] + np.arange(width)[None])
    table = torch.as_tensor(kv.table([r.blocks for r in reqs], blocks_for(t, kv.block_size)))
    mask = (torch.arange(t)[None, None, :] <= pos[:, :, None])[:, None]
    out = runner.forward(torch.as_tensor(tokens), pos, pos, kv.target, kv.rows(table, t), mask)
    return out.logits, out.taps


def _packed(runner, kv, chunks, native: bool = True):
    """Logits and taps [1, N, ...]."""
    batch = prefill_batch(chunks, kv)
    pos, slots = torch.as_tensor(batch.positions), torch.as_tensor(batch.slots)
    attend = chunk_attention(runner.attention, kv, slots, pos, torch.as_tensor(batch.tables), list(batch.spans),
                             torch.as_tensor(np.asarray(batch.spans, dtype=np.int64)),
                             groups=runner.groups, dtype=runner.dtype, scale=runner.scaling, native=native)
    out = runner.run(torch.as_tensor(batch.tokens)[None], pos[None], attend)
    return out.logits, out.taps, batch, attend


@pytest.fixture(scope="module")
def pairs():
    return {"qwen3": random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3"),
            "llama": random_pair(512, 0)}


@pytest.mark.parametrize(("path", "native"), [(AttentionPath.REFERENCE, False), (AttentionPath.GROUPED, True),
                                             (AttentionPath.GROUPED, False)])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_packed_prefill_is_the_padded_forward(pairs, family, path, native):
    """Three requests mid-prompt (shuffled blocks, contexts of random keys before each
    chunk), chunks of different widths: every real token's logits and taps, and the keys
    and values it stores, are the padded forward's. On the grouped path, with the chunks'
    native call (``treespark.kernels.chunks``) and without it (chunk by chunk through SDPA,
    as on an accelerator)."""
    from treespark.kernels.chunks import can_attend

    if native and not can_attend(torch.float32, torch.zeros(1, 1, 16)):
        pytest.skip("no native chunk attention here")
    pair = pairs[family]
    runner = TargetRunner(pair.target, pair.drafter.config.target_layer_ids, ProductPlan.fixed(F_LINEAR), path)
    dc = pair.drafter.config
    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=g).tolist() for n in (40, 70, 33)]
    computed, sizes = [0, 37, 16], [21, 11, 5]          # one at its start, one past a block edge
    order = rng.permutation(np.arange(1, 16)).tolist()  # shuffled blocks, every request its own
    blocks = [order[:3], order[3:8], order[8:11]]
    out = {}
    for how in ("padded", "packed"):
        kv = PagedKV(runner.store_shape, StoreShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim),
                     num_blocks=16, block_size=16, device=torch.device("cpu"), dtype=runner.dtype)
        s = torch.Generator().manual_seed(2)
        for t in (kv.target.k, kv.target.v):
            t[:, 16:] = torch.randn(t[:, 16:].shape, generator=s)     # the contexts before the chunks
        reqs = [_request(str(i), p, b, c) for i, (p, b, c) in enumerate(zip(prompts, blocks, computed, strict=True))]
        chunks = list(zip(reqs, sizes, strict=True))
        if how == "packed":
            *packed, _, attend = _packed(runner, kv, chunks, native)
            assert (attend.packed is not None) == native
        out[how] = (_padded(runner, kv, reqs, chunks) if how == "padded" else tuple(packed)), kv
    (logits, taps), kv_padded = out["padded"]
    (packed_logits, packed_taps), kv_packed = out["packed"]
    assert packed_logits.shape[:2] == (1, sum(sizes))
    offset = 0
    for i, m in enumerate(sizes):
        torch.testing.assert_close(packed_logits[0, offset:offset + m], logits[i, :m], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(packed_taps[0, offset:offset + m], taps[i, :m], atol=1e-4, rtol=1e-4)
        assert torch.equal(packed_logits[0, offset:offset + m].argmax(-1), logits[i, :m].argmax(-1))
        slots = kv_packed.slots(blocks[i], list(range(computed[i], computed[i] + m)))
        for store in ("k", "v"):
            torch.testing.assert_close(getattr(kv_packed.target, store)[:, slots],
                                       getattr(kv_padded.target, store)[:, slots], atol=1e-5, rtol=1e-5)
        offset += m


def test_chunks_ride_in_the_decode_steps_verify_forward(mimic16):
    """While requests decode, a step's prefill chunks go through the verify forward (one
    target forward a step), and every request's output is what it is alone: greedy rows
    equal plain decoding, a seeded sampled row its own output alone, a first token's
    logprobs included; a long prompt prefills over several such steps, each forward's
    prompt tokens what the trees leave of the budget, at least a chunk less a token a
    decoding row."""
    from treespark import Budget, generate
    from treespark.engine.config import EngineConfig
    from treespark.engine.core import Engine

    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, 16, (70,), generator=g).tolist()
    short = [torch.randint(0, 16, (n,), generator=g).tolist() for n in (5, 9)]
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=4, logprobs=2)

    def serve(arrivals: dict[int, list]) -> tuple[dict, dict, list[int]]:
        engine = Engine(mimic16, EngineConfig(max_batch_size=4, max_context=160, prefill_chunk=16, block_size=8,
                                              max_num_batched_tokens=24), budget=Budget(0.0, 6, 2))
        calls = []
        layers = engine.runner.layers

        def counted(tokens, positions, attend):
            calls.append(tokens.numel())
            return layers(tokens, positions, attend)

        engine.runner.layers = counted
        out: dict[str, list[int]] = {}
        lps: dict[str, list] = {}
        per_step, step = [], 0
        while engine.has_unfinished() or any(s >= step for s in arrivals):
            for rid, prompt, params in arrivals.get(step, []):
                engine.add_request(rid, prompt, params)
            before = len(calls)
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                lps.setdefault(o.request_id, []).extend(o.logprobs or ())
            per_step.append(len(calls) - before)
            step += 1
        # two rows' 7-slot trees leave 10 of the 24 tokens: the prompt gets a chunk less a token a row (14),
        # not a whole chunk (16) beside them
        assert max(calls) <= 14 + 14, "a step's prompt tokens: what the trees leave, at least a chunk less a token a row"
        return out, lps, per_step

    arrivals = {0: [("a", short[0], SamplingParams(max_tokens=20)), ("s", short[1], sampled)],
                2: [("long", long, SamplingParams(max_tokens=6))]}
    out, lps, per_step = serve(arrivals)
    assert max(per_step) == 1, "a step runs one target forward, its chunks inside the verify forward"
    assert out["long"] == generate(mimic16, long, max_new_tokens=6, budget=Budget.off()).token_ids
    assert out["a"] == generate(mimic16, short[0], max_new_tokens=20, budget=Budget.off()).token_ids
    alone, alone_lps, _ = serve({0: [("s", short[1], sampled)]})
    assert out["s"] == alone["s"] and len(out["s"]) == 12
    assert [lp.token_id for lp in lps["s"]] == out["s"]
    assert [round(lp.logprob, 5) for lp in lps["s"]] == [round(lp.logprob, 5) for lp in alone_lps["s"]]

"""The engine's device-side shape: what crosses to the host per step, and the GPU pair's
architecture in miniature (a tiny Qwen3 target at the full 151,936-token vocabulary)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from treespark import Budget, generate, random_pair
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.spec.params import SamplingParams
from treespark.spec.select import TOP_M

QWEN3_VOCAB = 151_936
BUDGET = Budget(theta=0.0, node_cap=8, branch_cap=2)


@pytest.fixture(scope="module")
def qwen3_pairs():
    return {v: random_pair(v, 0, block_size=5, markov_rank=16, family="qwen3") for v in (512, QWEN3_VOCAB)}


class ScalarReads(TorchDispatchMode):
    """Counts tensor-to-Python reads (``.item()``, ``int(t)``, ``bool(t)``): on a GPU each
    is a hidden host sync."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def decode(pair, temperature, *, watch=False):
    engine = Engine(pair, EngineConfig(max_batch_size=2, max_context=64), budget=BUDGET)
    stats = []
    engine.on_step = stats.append
    for i in range(2):
        engine.add_request(str(i), [3 + i, 1, 4, 1, 5], SamplingParams(temperature=temperature,
                                                                      max_tokens=12, seed=i))
    reads = ScalarReads()
    while engine.has_unfinished():
        if watch and len(stats) >= 2:   # both requests running: watch the decode steps
            with reads:
                engine.step()
        else:
            engine.step()
    return stats, reads.count


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_host_copies_do_not_grow_with_the_vocabulary(qwen3_pairs, temperature):
    """The same trees at 512 and 151,936 tokens: every step's host copies stay within a
    bound set by the tree budget alone, and so do its syncs."""
    block = 5
    per_wave = 2 * (BUDGET.node_cap + 1) * (2 * TOP_M + 2 * BUDGET.branch_cap)  # parents x numbers
    verify = 2 * (BUDGET.node_cap + 1) + 2 * (block + 2)
    for v, pair in qwen3_pairs.items():
        stats, _ = decode(pair, temperature)
        speculating = [s for s in stats if s.draft_waves > 0]
        assert speculating, f"no step drafted at V={v}"
        for s in stats:
            assert s.host_elements <= s.draft_waves * per_wave + verify + 1, (v, s)
            # one per wave, one for verification, one for a first token after prefill
            assert s.draft_waves <= block and s.host_syncs <= s.draft_waves + 2, (v, s)


def test_decode_steps_read_no_hidden_scalars(qwen3_pairs):
    """Beyond the counted copies, a decode step never reads a tensor into Python."""
    for temperature in (0.0, 1.0):
        _, reads = decode(qwen3_pairs[512], temperature, watch=True)
        assert reads == 0


def test_greedy_trees_equal_plain_decoding_on_a_qwen3_sized_vocabulary(qwen3_pairs):
    pair = qwen3_pairs[QWEN3_VOCAB]
    prompt = [11, 2024, 151_000, 7]
    plain = generate(pair, prompt, max_new_tokens=16, budget=Budget.off())
    for budget in (Budget.chain(3), Budget(0.0, 16, 4)):
        out = generate(pair, prompt, max_new_tokens=16, budget=budget)
        assert out.token_ids == plain.token_ids
        assert sum(r.tree_size for r in out.rounds) > 0


def test_a_draft_vocabulary_maps_back_to_token_ids():
    """With a reduced draft vocabulary the drafted tokens are target ids inside it, and
    sampled decoding stays seeded-deterministic."""
    pair = random_pair(2048, 1, block_size=4, markov_rank=8, family="qwen3", draft_vocab=256)
    a = generate(pair, [5, 6, 7], max_new_tokens=10, temperature=1.0, seed=3, budget=Budget(0.0, 8, 2))
    b = generate(pair, [5, 6, 7], max_new_tokens=10, temperature=1.0, seed=3, budget=Budget(0.0, 8, 2))
    assert a.token_ids == b.token_ids
    greedy = generate(pair, [5, 6, 7], max_new_tokens=10, budget=Budget.off()).token_ids
    assert generate(pair, [5, 6, 7], max_new_tokens=10, budget=Budget(0.0, 8, 2)).token_ids == greedy


def test_random_pair_families():
    q = random_pair(64, 0, family="qwen3")
    assert q.target.config.tie_word_embeddings and hasattr(q.target.model.layers[0].self_attn, "q_norm")
    assert q.target.config.num_key_value_heads < q.target.config.num_attention_heads
    with pytest.raises(ValueError, match="family"):
        random_pair(64, 0, family="gpt2")


def test_every_eos_id_of_the_generation_config_stops(qwen3_pairs):
    """Qwen3 ends a reply with <|im_end|> or <|endoftext|>: both stop a request."""
    from dataclasses import replace

    class Tok:
        eos_token_id = 7

    pair = replace(qwen3_pairs[512], tokenizer=Tok())
    pair.target.generation_config.eos_token_id = [11, 7, 13]
    assert pair.stop_token_ids == (11, 7, 13)
    pair.target.generation_config.eos_token_id = 5
    assert pair.stop_token_ids == (5, 7)
    assert qwen3_pairs[512].stop_token_ids == ()

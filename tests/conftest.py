"""Shared fixtures: random pairs and a *mimic* pair whose drafter nearly equals its target."""

from __future__ import annotations

import os

import pytest
import torch

from treespark import ModelPair, random_pair

torch.set_num_threads(min(2, os.cpu_count() or 1))
# one test process compiles the forward's layer ops for many models, dtypes and backends
# (each a graph of its own); a replica compiles a handful
torch._dynamo.config.recompile_limit = 64


def make_mimic_pair(vocab_size: int = 16, seed: int = 0, block_size: int = 4,
                    attention_scale: float = 0.03) -> ModelPair:
    """A pair whose drafter proposes (almost) the target's own distributions.

    The target is made nearly a bigram model (its MLPs off, its attention outputs scaled
    down), and the drafter's Markov head holds exactly the target's bigram logits
    (W1 = bigram table, W2 = identity, base logits U = 0). Acceptance is then high
    but not perfect: both the accept and the reject paths of verification run.
    """
    pair = random_pair(vocab_size, seed, block_size)
    t, d = pair.target, pair.drafter
    with torch.no_grad():
        for layer in t.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
            layer.mlp.down_proj.weight.zero_()
        # the bigram part of the target: logits of a lone token, no context at all
        e = t.model.embed_tokens.weight
        bigram = t.lm_head(t.model.norm(e))                         # [V, V]
    from treespark.models.drafter import DSparkDrafter
    from treespark.models.drafter_config import DSparkConfig

    cfg = DSparkConfig(**{**d.config.__dict__, "markov_rank": vocab_size})
    drafter = DSparkDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.zero_()
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        drafter.markov_head.markov_w1.weight.copy_(bigram)           # W1[parent] = logits row
        drafter.markov_head.markov_w2.weight.copy_(torch.eye(vocab_size))
    return ModelPair(target=t, drafter=drafter.eval(), tokenizer=None, name=f"mimic-v{vocab_size}")


@pytest.fixture(scope="session")
def pair64() -> ModelPair:
    return random_pair(64, 0)


@pytest.fixture(scope="session")
def mimic16() -> ModelPair:
    return make_mimic_pair(16, 0)

"""The honest drafter metric: its chain simulation is the engine's greedy chain, exactly."""

from __future__ import annotations

import torch

from treespark import random_pair
from treespark.training.judge import chain_rounds, engine_chain_tau, heldout_features, judge


def test_chain_rounds_tables():
    every = torch.ones(10, 3, dtype=torch.bool)
    # 10 tokens, the first from prefill; each round drafts 3 and keeps all + 1 bonus, the
    # last round only has room for 1 draft (max_tokens - emitted - 1)
    assert chain_rounds(every, 3, 10) == (3, 6)
    none = torch.zeros(10, 3, dtype=torch.bool)
    assert chain_rounds(none, 3, 10) == (9, 0)
    # a mismatch at row 1 stops the walk, whatever follows
    m = torch.zeros(10, 3, dtype=torch.bool)
    m[:, 0] = True
    m[:, 2] = True
    assert chain_rounds(m, 3, 10) == (5, 4)
    assert chain_rounds(every, 3, 4) == (1, 2)           # max_tokens cuts the answer


def test_simulated_chain_tau_is_the_engines():
    # a tiny vocabulary, so a random drafter is right often enough to accept runs
    pair = random_pair(6, 4, block_size=3)
    feats = heldout_features(pair, n_prompts=6, max_tokens=24, progress=False)
    got = judge(pair.drafter, feats, max_tokens=24)
    engine = engine_chain_tau(pair, 6, 24, (1, 2, 3))
    assert got.chain_tau == tuple(engine[k] for k in (1, 2, 3))
    assert got.chain_tau[0] > 1.05                       # it did accept something
    assert abs(got.first_token - (got.chain_tau[0] - 1)) < 0.1

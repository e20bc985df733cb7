"""The honest drafter metric: its chain simulation is the engine's greedy chain, exactly."""

from __future__ import annotations

import pytest
import torch

from treespark import random_pair
from treespark.judge import chain_rounds, engine_chain_tau, greedy_answer_features, judge, sampled_acceptance


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
    feats = greedy_answer_features(pair, n_prompts=6, max_tokens=24, progress=False)
    got = judge(pair.drafter, feats, max_tokens=24)
    engine = engine_chain_tau(pair, 6, 24, (1, 2, 3))
    assert got.chain_tau == tuple(engine[k] for k in (1, 2, 3))
    assert got.chain_tau[0] > 1.05                       # it did accept something
    assert abs(got.first_token - (got.chain_tau[0] - 1)) < 0.1


def test_sampled_acceptance_is_one_minus_tv_after_each_answer_position():
    """sum_x min(p, q) at every answer anchor, against the target run on each prefix
    alone: p is the distribution after the anchor, q the drafter's first row there."""
    pair = random_pair(6, 4, block_size=3)
    feats = greedy_answer_features(pair, n_prompts=3, max_tokens=8, progress=False)
    got = sampled_acceptance(pair.drafter, pair.target, feats, (0.5, 1.0), temperature=0.8)
    blk = pair.drafter.config.block_size
    want = {0.5: [], 1.0: []}
    with torch.no_grad():
        for seq in range(len(feats)):
            sl = feats.sequence(seq)
            tokens, start = feats.tokens[sl], int(feats.answer_start[seq])
            padded = torch.cat([tokens, torch.full((blk,), pair.drafter.config.mask_token_id)])
            taps = torch.cat([feats.taps[sl].float(), torch.zeros(blk, feats.taps.shape[1])])
            for a in range(start, tokens.numel() - 1):
                p = torch.softmax(pair.target(tokens[None, :a + 1]).logits[0, -1].float() / 0.8, -1)
                row = pair.drafter.train_logits(taps, padded, torch.tensor([a]))[0, 0].float()
                for s in want:
                    want[s].append(float(torch.minimum(p, torch.softmax(row / (s * 0.8), -1)).sum()))
    assert set(got) == {0.5, 1.0}
    for s, values in want.items():
        assert got[s] == pytest.approx(sum(values) / len(values), abs=1e-5)
    assert got[0.5] != pytest.approx(got[1.0], abs=1e-3)

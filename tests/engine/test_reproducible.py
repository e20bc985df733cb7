"""Reproducible sampled requests (``SamplingParams.reproducible``): each token is the
Gumbel-max draw keyed by (seed, its index) (``treespark.spec.gumbel``), so a seeded
request's tokens are the definition written out over plain forwards, whatever the
budget, the per-step allocation, the batch or preemption; a request of prompt + its first
n tokens continues with exactly the rest; the drafts share the target's noise (they are
accepted about as often as the walk's); their edge records stay out of the walk's map."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import prompts, run
from tests.engine.test_paged_kv import preempting
from treespark import Budget, generate
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.run import run_engine
from treespark.engine.step_alloc import StepAllocator
from treespark.pricing.allocate import StepCosts
from treespark.pricing.costmodel import CostModel
from treespark.spec.gumbel import keyed_gumbel, position_keys, seed_words
from treespark.spec.params import SamplingParams, StepStats
from treespark.spec.sampling import target_probs

PROMPT = [5, 6, 7]
BUDGETS = [Budget.off(), Budget.chain(3), Budget(0.0, 16, 4), Budget.adaptive()]


def keyed(temperature=1.0, max_tokens=24, seed=7, top_p=1.0):
    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed, reproducible=True)


@torch.no_grad()
def by_definition(pair, prompt, n, seed, temperature, top_p=1.0) -> list[int]:
    """x_n = argmax over the nucleus of logits_n / T + G(seed, n, v), over plain forwards."""
    lo, hi = seed_words(seed)
    seq = list(prompt)
    for _ in range(n):
        logits = pair.target(torch.tensor([seq])).logits[0, -1].double()
        key = position_keys(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([len(seq)]))
        scores = logits / temperature + keyed_gumbel(key, torch.arange(logits.numel()))[0]
        scores[target_probs(logits, temperature, top_p) == 0] = float("-inf")
        seq.append(int(scores.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_the_engine_draws_the_definition_under_every_budget(pair64, temperature, top_p):
    want = by_definition(pair64, PROMPT, 24, 7, temperature, top_p)
    for budget in BUDGETS:
        got = generate(pair64, PROMPT, max_new_tokens=24, temperature=temperature, top_p=top_p, seed=7,
                       budget=budget, reproducible=True)
        assert got.token_ids == want, budget
    assert by_definition(pair64, PROMPT, 24, 8, temperature, top_p) != want   # the seed matters


def test_the_same_tokens_alone_in_a_batch_and_under_the_per_step_allocation(mimic16):
    """A reproducible request among greedy, walked and other reproducible requests arriving
    at other steps, under several budgets and the per-step allocator: its tokens are
    plain decoding's, and the trees did accept draft tokens."""
    params = keyed(max_tokens=30, seed=11)
    plain = generate(mimic16, PROMPT, max_new_tokens=30, temperature=1.0, seed=11, budget=Budget.off(),
                     reproducible=True).token_ids
    others = [(f"o{i}", p, SamplingParams(temperature=[0.0, 1.0, 0.8][i % 3], max_tokens=12 + i, seed=i,
                                          reproducible=i % 3 == 2))
              for i, p in enumerate(prompts(6, 16, seed=3))]
    for budget in BUDGETS[1:]:
        for allocate in (False, True):
            engine = Engine(mimic16, EngineConfig(max_batch_size=4, max_context=64), budget=budget)
            if allocate:
                engine.set_allocator(StepAllocator(StepCosts(CostModel.affine(0.01, 0.001), max_nodes=16)))
            stats: list[StepStats] = []
            engine.on_step = stats.append
            tokens, _ = run(engine, {0: others[:2], 1: [("x", PROMPT, params)], 3: others[2:]})
            assert tokens["x"] == plain, (budget, allocate)
            assert max(s.batch_size for s in stats) >= 3 and sum(sum(s.accepted) for s in stats) > 0


def test_the_same_tokens_through_preemption(pair64):
    budget = Budget(0.0, 4, 2)
    reqs = [(f"r{i}", [i + 1, 5, 7, 11, 2, 3, 9, 8, 1, 4][: 6 + i], keyed(max_tokens=36, seed=10 + i))
            for i in range(3)]
    tight = preempting(pair64, kv_blocks=18, budget=budget)
    tokens, _ = run(tight, {0: reqs})
    assert tight.preemptions > 0
    for rid, prompt, params in reqs:
        assert tokens[rid] == generate(pair64, prompt, max_new_tokens=36, temperature=1.0, seed=params.seed,
                                       budget=Budget.off(), reproducible=True).token_ids


@pytest.mark.parametrize("cut", [1, 7, 16])
def test_a_resumed_request_continues_with_exactly_the_rest(mimic16, cut):
    """Prompt + the first ``cut`` tokens, the same seed, another budget: the rest."""
    whole = generate(mimic16, PROMPT, max_new_tokens=30, temperature=1.0, seed=5, reproducible=True).token_ids
    rest = generate(mimic16, PROMPT + whole[:cut], max_new_tokens=30 - cut, temperature=1.0, seed=5,
                    budget=Budget.chain(2), reproducible=True).token_ids
    assert rest == whole[cut:]


def test_the_drafts_share_the_targets_noise(mimic16):
    """On a drafter that nearly is its target, keyed chains are accepted about as often
    as the walk's (drafts drawn with other noise than the target's: tau 1.19 against the
    walk's 2.21 on these prompts); the tokens differ from the walk's."""
    ps = prompts(8, 16, seed=0)
    walk = run_engine(mimic16, ps, Budget.chain(3), max_tokens=32, batch_size=8, temperature=1.0, seed=0)
    coupled = run_engine(mimic16, ps, Budget.chain(3), max_tokens=32, batch_size=8, temperature=1.0, seed=0,
                         reproducible=True)
    assert coupled.tau > 0.85 * walk.tau and coupled.tau > 1.8, (coupled.tau, walk.tau)
    assert coupled.token_ids != walk.token_ids


def test_reproducible_needs_a_seed_and_leaves_greedy_alone(pair64):
    with pytest.raises(ValueError, match="needs a seed"):
        SamplingParams(temperature=1.0, reproducible=True)
    with pytest.raises(ValueError, match="must be a bool"):
        SamplingParams(temperature=1.0, seed=1, reproducible=1)
    assert SamplingParams(temperature=0.0, reproducible=True).keyed is False
    greedy = generate(pair64, PROMPT, max_new_tokens=12).token_ids
    assert generate(pair64, PROMPT, max_new_tokens=12, reproducible=True).token_ids == greedy


def test_reproducible_rows_leave_the_walks_records_alone(mimic16):
    engine = Engine(mimic16, EngineConfig(max_batch_size=2, max_context=64), budget=Budget(0.0, 8, 3))
    stats: list[StepStats] = []
    engine.on_step = stats.append
    engine.add_request("a", PROMPT, keyed(max_tokens=16, seed=1))
    while engine.has_unfinished():
        engine.step()
    assert sum(s.tree_sizes[0] for s in stats) > 0
    assert not any(s.sampled_records or s.calibration_records for s in stats)

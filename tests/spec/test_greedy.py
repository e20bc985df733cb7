"""Layer a: greedy speculative decoding returns exactly the target's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from treespark import Budget, generate, random_pair

BUDGETS = {
    "chain4": Budget.chain(4),
    "wide": Budget(theta=0.0, node_cap=24, branch_cap=6),
    "deep": Budget(theta=0.0, node_cap=12, branch_cap=1),
    "adaptive": Budget.adaptive(),
    "theta0.3": Budget(theta=0.3, node_cap=16, branch_cap=3),
}


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@torch.no_grad()
def hf_greedy(pair, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding through the transformers model itself, no cache: an independent
    reference for our KV-cached forward."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(pair.target(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_pairs_match_plain_decoding(seed):
    pair = random_pair(96, seed, block_size=4)
    for prompt in prompts(96, 4, seed):
        plain = generate(pair, prompt, max_new_tokens=24, budget=Budget.off()).token_ids
        assert plain == hf_greedy(pair, prompt, 24), "our plain decoding must equal HF greedy"
        for name, budget in BUDGETS.items():
            out = generate(pair, prompt, max_new_tokens=24, budget=budget)
            assert out.token_ids == plain, f"budget {name} changed the greedy output"


def test_mimic_pair_matches_and_accepts(mimic16):
    total_rounds, total_tokens = 0, 0
    for prompt in prompts(16, 6, 7):
        plain = generate(mimic16, prompt, max_new_tokens=32, budget=Budget.off())
        assert plain.tokens_per_round == 1.0 and len(plain.rounds) == 31
        for name, budget in BUDGETS.items():
            out = generate(mimic16, prompt, max_new_tokens=32, budget=budget)
            assert out.token_ids == plain.token_ids, f"budget {name} changed the greedy output"
            if budget.theta == 0:
                total_rounds += len(out.rounds)
                total_tokens += len(out.token_ids) - 1
    # the drafter mimics the target: many drafts are accepted, so deep paths were exercised
    assert total_tokens / total_rounds > 2.0


def test_rounds_report_tree_shapes(mimic16):
    out = generate(mimic16, [1, 2, 3], max_new_tokens=20, budget=Budget.chain(3))
    assert all(r.width <= 1 and r.tree_size <= 3 for r in out.rounds)
    assert any(r.accepted > 0 for r in out.rounds)
    off = generate(mimic16, [1, 2, 3], max_new_tokens=20, budget=Budget.off())
    assert all(r.tree_size == 0 and r.accepted == 0 for r in off.rounds)
    wide = generate(mimic16, [1, 2, 3], max_new_tokens=20, budget=Budget(0.0, 12, 4))
    assert max(r.width for r in wide.rounds) > 1
    assert sum(len(wide.token_ids) for _ in [0]) == 20


def test_max_new_tokens_and_stop_tokens(pair64):
    plain = generate(pair64, [3, 4, 5], max_new_tokens=30, budget=Budget.off()).token_ids
    for n in (1, 2, 7):
        assert generate(pair64, [3, 4, 5], max_new_tokens=n).token_ids == plain[:n]
    stop = plain[5]
    out = generate(pair64, [3, 4, 5], max_new_tokens=30, stop_token_ids=(stop,))
    assert out.token_ids == plain[: plain.index(stop) + 1] and out.finish_reason == "stop"

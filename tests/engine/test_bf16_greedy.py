"""What greedy speculative decoding guarantees in each dtype (the sentence the docs state).

float32: the tree's output equals plain decoding token for token. bfloat16: every token
is the argmax of the verify forward's logits, whose rounding depends on the forward's
shape (a tree of K nodes, not one token), so the output may leave plain decoding's,
but only where plain decoding's top two logits are within bfloat16 rounding (a couple
of ulps). Measured on CPU (tiny random Qwen3 pairs, 3 seeds x 12 prompts x 24 tokens):
27 of 36 matched plain decoding token for token; every divergence began at a margin of
at most 2 ulps (0.0625 at logits of 5 to 8).
"""

from __future__ import annotations

import math

import pytest
import torch

from treespark.engine.run import generate
from treespark.models.pair import random_pair
from treespark.spec.budget import Budget


def _ulp_bf16(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tree_leaves_plain_decoding_only_at_rounding_ties(dtype):
    pair = random_pair(256, 1, family="qwen3")
    pair.target.to(dtype)
    pair.drafter.to(dtype)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        prompt = torch.randint(1, 255, (12,), generator=g).tolist()
        plain = generate(pair, prompt, max_new_tokens=24, budget=Budget.off()).token_ids
        tree = generate(pair, prompt, max_new_tokens=24, budget=Budget(0.0, 32, 4)).token_ids
        if dtype == torch.float32:
            assert tree == plain
            continue
        j = next((k for k, (a, b) in enumerate(zip(tree, plain, strict=True)) if a != b), None)
        if j is None:
            continue
        with torch.no_grad():
            logits = pair.target(torch.tensor([prompt + plain[:j]])).logits[0, -1].float()
        margin = float(logits[plain[j]] - logits[tree[j]])
        assert abs(margin) <= 4 * _ulp_bf16(float(logits[plain[j]])), (j, margin)

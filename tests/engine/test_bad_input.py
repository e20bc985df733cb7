"""Bad input to the public API raises ValueError saying what is wrong."""

from __future__ import annotations

import pytest

from treespark import Budget, generate


@pytest.mark.parametrize("kwargs,match", [
    ({"prompt_ids": []}, "empty"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"max_new_tokens": 0}, "max_tokens"),
    ({"max_new_tokens": -3}, "max_tokens"),
    ({"prompt_ids": [1, 2, 64]}, "outside the vocabulary"),
    ({"prompt_ids": [1, -1]}, "outside the vocabulary"),
    ({"prompt_ids": [1, 2.5]}, "integers"),
    ({"prompt_ids": "hello"}, "list of token ids"),
    ({"top_p": 0.0}, "top_p"),
    ({"budget": "tree"}, "Budget"),
    ({"seed": 1.5}, "seed"),
])
def test_generate_rejects(pair64, kwargs, match):
    args = {"prompt_ids": [1, 2, 3], "max_new_tokens": 4} | kwargs
    prompt = args.pop("prompt_ids")
    with pytest.raises(ValueError, match=match):
        generate(pair64, prompt, **args)


@pytest.mark.parametrize("kwargs", [
    {"theta": 0.1, "node_cap": -1, "branch_cap": 2},
    {"theta": -0.1, "node_cap": 4, "branch_cap": 2},
    {"theta": float("nan"), "node_cap": 4, "branch_cap": 2},
    {"theta": 0.1, "node_cap": 4, "branch_cap": 0},
    {"theta": 0.1, "node_cap": 2.5, "branch_cap": 2},
])
def test_budget_rejects(kwargs):
    with pytest.raises(ValueError, match="Budget"):
        Budget(**kwargs)


def test_budget_shapes():
    assert Budget.chain(4) == Budget(0.0, 4, 1) and Budget.chain(4).kind == "chain"
    assert Budget.off().is_off and Budget.off().kind == "off"
    assert Budget.adaptive().kind == "tree"

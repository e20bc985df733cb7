"""The shipped default pair: the committed drafter loads strictly and really accepts.

Every test here loads the default target from the model cache (``make test`` fills it
first with ``make fetch-model``; without a warm cache, ``load_pair`` downloads it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from treespark import Budget, generate, load_pair
from treespark.models.chat import chat_ids
from treespark.models.pair import default_drafter_dir

pytestmark = pytest.mark.default_pair

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the factorial of n.",
    "Give three tips for staying focused while studying.",
]


@pytest.fixture(scope="module")
def pair():
    return load_pair(device="cpu", progress=False)


def test_committed_drafter_loads_strictly(pair):
    from treespark.models.checkpoint import load_drafter

    d = load_drafter(default_drafter_dir(), target=pair.target)  # strict: any stray key fails
    assert d.config.shared_embeddings and d.d2t is not None
    assert pair.calibration.a > 0, "the shipped calibration must rank by q"


def test_default_pair_accepts_and_stays_greedy(pair):
    """A floor that catches a broken or weakened checkpoint: >= 2.0 tokens per round at
    T = 0 with 32-node trees of the default width (the shipped drafter: 2.14 on these
    prompts at 8 children a node, 2.04 at 4; the ones before it, at 4: 2.14 (86 greedy +
    47 sampled chat shards), 2.20 (86 + 22), 2.04 (60 chat shards), 2.14 (30) and 2.20
    (base); an untrained drafter ~1)."""
    rounds = tokens = 0
    eos = (pair.tokenizer.eos_token_id,)
    for text in PROMPTS:
        ids = chat_ids(pair.tokenizer, text)
        out = generate(pair, ids, max_new_tokens=48, stop_token_ids=eos, budget=Budget.adaptive(theta=0.0))
        plain = generate(pair, ids, max_new_tokens=48, budget=Budget.off(), stop_token_ids=eos)
        assert out.token_ids == plain.token_ids
        rounds += len(out.rounds)
        tokens += len(out.token_ids) - 1       # the first token comes from prefill
    assert tokens / rounds >= 2.0


def test_cli_generate_check():
    proc = subprocess.run(
        [sys.executable, "-m", "treespark.cli", "generate", "Name three colours.", "--max-tokens", "16",
         "--check", "--rounds", "--device", "cpu"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    assert "identical to plain greedy decoding: True" in proc.stderr
    assert "round   0: tree" in proc.stderr

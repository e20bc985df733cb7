"""The engine with its target forward compiled (``EngineConfig.compile_backend``) keeps
every guarantee the eager one does: greedy trees give plain decoding's tokens, a seeded
sampled request's tokens do not depend on its batch, and sampled tokens follow the
target's distribution. The graphs are traced by torch.compile and run by ``aot_eager``
(torch's own kernels), which keeps these tests fast; inductor's kernels are checked
against transformers' logits in test_fused_forward.py."""

from __future__ import annotations

import pytest

from tests.engine.test_engine import prompts, run
from tests.spec.test_sampled import PROMPT, chi2_pvalue, exact_marginals, seeded_samples
from treespark import Budget, generate
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.spec.params import SamplingParams


def _engine(pair, budget: Budget, rows: int = 8, context: int = 128) -> Engine:
    engine = Engine(pair, EngineConfig(max_batch_size=rows, max_context=context, prefill_chunk=64,
                                       compile_backend="aot_eager"),
                    budget=budget)
    assert engine.runner.ops.backend == "aot_eager"
    return engine


@pytest.mark.parametrize("budget", [Budget.chain(3), Budget(0.0, 16, 4)])
def test_compiled_greedy_trees_equal_plain_decoding(mimic16, budget):
    ps, lengths = prompts(6, 16, seed=1), [5, 17, 9, 30, 2, 12]
    arrivals = {i // 2: [] for i in range(6)}
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        arrivals[i // 2].append((f"r{i}", p, SamplingParams(max_tokens=n)))
    spec, _ = run(_engine(mimic16, budget), arrivals)
    plain, _ = run(_engine(mimic16, Budget.off()), arrivals)
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        eager = generate(mimic16, p, max_new_tokens=n, budget=Budget.off()).token_ids
        assert spec[f"r{i}"] == plain[f"r{i}"] == eager  # float32: the compiled forward's argmax is eager's


def test_compiled_sampled_request_is_the_same_alone_and_in_a_batch(mimic16):
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=42)
    alone, _ = run(_engine(mimic16, Budget(0.0, 8, 3)), {0: [("x", [1, 2, 3], params)]})
    others = [(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=15, seed=i))
              for i, p in enumerate(prompts(5, 16, seed=3))]
    batched, _ = run(_engine(mimic16, Budget(0.0, 8, 3)), {0: others[:2], 1: [("x", [1, 2, 3], params)] + others[2:]})
    assert batched["x"] == alone["x"] and len(alone["x"]) == 20


def test_compiled_sampled_tokens_follow_the_target(mimic16):
    n = 3000
    samples, accepted = seeded_samples(mimic16, n, 1.0, Budget(theta=0.0, node_cap=6, branch_cap=3),
                                       compile_backend="aot_eager")
    assert accepted > n // 2, "the trees must be accepted often for the test to mean something"
    m2, m3 = exact_marginals(mimic16, PROMPT, 1.0)
    assert chi2_pvalue([t[1] for t in samples], m2) > 0.01
    assert chi2_pvalue([t[2] for t in samples], m3) > 0.01

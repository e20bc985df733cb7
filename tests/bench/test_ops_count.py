"""The operator count of ``treespark bench ops``: what it counts as one call."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from treespark import random_pair
from treespark.bench.forward_calls import verify_call
from treespark.bench.ops import COMPILED_REGION, count_ops, top_level_ops
from treespark.engine.target import TargetRunner
from treespark.kernels import blocks
from treespark.kernels.linear import F_LINEAR, NATIVE, ProductPlan
from treespark.kernels.native import library


def test_a_compiled_region_counts_as_one_call_and_the_compiled_forward_calls_fewer():
    pair = random_pair(512, 0)
    counts, logits = {}, {}
    for name, kwargs in (("fused", {}), ("compiled", {"compile_backend": "inductor"})):
        runner = TargetRunner(pair.target, (0,), ProductPlan.fixed(F_LINEAR), **kwargs)
        call, logits[name] = verify_call(runner, 1, (-1,), 512)
        counts[name] = count_ops(call)
    torch.testing.assert_close(logits["compiled"], logits["fused"], rtol=1e-4, atol=1e-4)
    fused, compiled = counts["fused"], counts["compiled"]
    assert compiled.called < fused.called and compiled.total < fused.total
    # a compiled region is one call, and what runs inside it is not counted again: per layer
    # two norms (the first layer's alone, the rest with the residual add), q/k rotation and
    # the activation; then the final norm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    regions = [e for e in top_level_ops(prof.events()) if e.name.startswith(COMPILED_REGION)]
    assert len(regions) == 4 * pair.target.config.num_hidden_layers + 1


@pytest.mark.skipif(library() is None, reason="no C compiler built treespark/kernels/")
def test_a_decoding_forward_on_the_native_blocks_calls_its_layers_once():
    """Over the engine's paged store, a batch-1 decoding forward on the native plan runs
    its whole layer stack as one operator: at most a fifth of the reference's calls."""
    pair = random_pair(512, 0)
    counts = {}
    for name, fused in (("reference", False), ("native", True)):
        runner = TargetRunner(pair.target, (0,), ProductPlan.fixed(NATIVE), fused=fused)
        call, _ = verify_call(runner, 1, (-1,), 512)
        counts[name] = count_ops(call)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        layers = [e for e in top_level_ops(prof.events()) if e.name == blocks.PROFILER_NAMES[3]]
        assert len(layers) == (1 if fused else 0)
    assert counts["native"].called <= 0.2 * counts["reference"].called, counts

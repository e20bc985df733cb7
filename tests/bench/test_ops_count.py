"""The operator count of ``treespark bench ops``: what it counts as one call."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from treespark import random_pair
from treespark.bench.forward_calls import verify_call
from treespark.bench.ops import COMPILED_REGION, count_ops, top_level_ops
from treespark.engine.target import TargetRunner
from treespark.kernels.linear import F_LINEAR, ProductPlan


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

"""What one engine step launches (the device check's preflight): on CUDA the kernels
the host launches in a step and inside its target forward, and the attention kernels
by name; on CPU the operators called (``treespark.bench.ops.top_level_ops``).

One full engine step runs under ``torch.profiler`` with the target forward marked by a
``record_function`` range; a launch counts toward the forward when the host call that
made it starts inside that range. A forward replayed from a CUDA graph counts its input
copies, its one graph launch and its LM head; a bucket captured inside the profiled step
is reported (``captures``), since its warm-up and capture launch the whole forward."""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from treespark.bench.device_pair import EAGER, POLICIES, Forward, products_for, random_prompts
from treespark.bench.ops import top_level_ops
from treespark.engine.core import Engine, EngineConfig
from treespark.models.pair import ModelPair
from treespark.spec.params import SamplingParams

VERIFY = "treespark.verify"
# the CUDA runtime and driver calls that put one kernel (or one graph) on a stream
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
ATTENTION_NAMES = ("flash", "fmha", "efficient", "attention", "cudnn", "sdpa", "softmax")


def profile_step(engine: Engine) -> dict[str, Any]:
    """Profile one ``engine.step()``: launches (CUDA) or operators (CPU) per step and per
    target forward, and the attention kernels' names on CUDA."""
    cuda = engine.device.type == "cuda"
    forward = engine.graphs if engine.graphs is not None else engine.runner  # whose forward verifies
    inner = forward.forward
    captured = None if engine.graphs is None else engine.graphs.captures

    def marked(*args, **kwargs):
        with record_function(VERIFY):
            return inner(*args, **kwargs)

    forward.forward = marked
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            engine.step()
            engine.sync()
    finally:
        del forward.forward  # the class's method again
    events = list(prof.events())
    # the host's range only: on CUDA the profiler also reports the range on the device's
    # timeline (a "gpu_user_annotation" of the same name), which lags the host
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.name == VERIFY and not str(e.device_type).endswith("CUDA")]
    if cuda:
        launches = [e for e in events if e.name.startswith(LAUNCH_CALLS)]
        kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
        attention = sorted({e.name[:80] for e in kernels if any(s in e.name.lower() for s in ATTENTION_NAMES)})
    else:
        launches, kernels, attention = top_level_ops(events), [], ["cpu"]
    in_verify = sum(any(a <= e.time_range.start < b for a, b in spans) for e in launches)
    return {"unit": "kernel launches" if cuda else "operators called", "per_step": len(launches),
            "per_forward": in_verify / max(len(spans), 1), "forwards": len(spans),
            "device_events": len(kernels) if cuda else None, "attention_kernels": attention,
            "captures": None if engine.graphs is None else engine.graphs.captures - captured}


def step_launches(pair: ModelPair, device: torch.device, seed: int, prompt_len: int = 64,
                  forward: Forward = EAGER) -> dict[str, Any]:
    """``profile_step`` at batch 1, T = 0, for plain decoding and a tree of 32 (after the
    prompt is prefilled and two steps have warmed up), with ``forward``'s target forward."""
    out = {}
    for name in ("plain", "tree of 32"):
        engine = Engine(pair, EngineConfig(max_batch_size=1, max_context=prompt_len + 256, max_tree_nodes=32,
                                           **forward.engine_args),
                        budget=POLICIES[name], products=products_for(device))
        (prompt,) = random_prompts(1, prompt_len, pair.vocab_size, seed)
        engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=200, seed=0))
        while engine.num_waiting:
            engine.step()
        for _ in range(2):
            engine.step()
        out[name + ("" if forward == EAGER else f", {forward.name}")] = profile_step(engine)
    return out

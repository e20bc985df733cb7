"""What one engine step launches (the device check's preflight): on CUDA the kernels
the host launches in a step, inside its target forward and inside its drafter pass, and the attention kernels
by name; on CPU the operators called (``treespark.bench.ops.top_level_ops``).

One full engine step runs under ``torch.profiler`` with the target forward and the
drafter's block pass each marked by a ``record_function`` range; a launch counts toward
one when the host call that made it starts inside its range. A pass replayed from a
CUDA graph counts its input copies, its one graph launch and its LM head; a bucket
captured inside the profiled step is reported (``captures``), since its warm-up and
capture launch the whole pass."""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from treespark.bench.device_pair import EAGER, POLICIES, Forward, products_for, random_prompts
from treespark.bench.ops import top_level_ops
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.models.pair import ModelPair
from treespark.spec.params import SamplingParams

VERIFY, DRAFT = "treespark.verify", "treespark.draft"
# the CUDA runtime and driver calls that put one kernel (or one graph) on a stream
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
ATTENTION_NAMES = ("flash", "fmha", "efficient", "attention", "cudnn", "sdpa", "softmax")


def profile_step(engine: Engine) -> dict[str, Any]:
    """Profile one ``engine.step()``: launches (CUDA) or operators (CPU) per step, per
    target forward and per drafter block pass, and the attention kernels' names on CUDA."""
    cuda = engine.device.type == "cuda"
    marked = ((engine.graphs if engine.graphs is not None else engine.runner, "forward", VERIFY),  # whose forward verifies
              (engine.draft_graphs if engine.draft_graphs is not None else engine.drafter, "block_logits", DRAFT))
    captured = engine.graph_captures
    for obj, method, name in marked:
        setattr(obj, method, _marked(getattr(obj, method), name))
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            engine.step()
            engine.decode.sync()
    finally:
        for obj, method, _ in marked:
            delattr(obj, method)  # the class's method again
    events = list(prof.events())
    if cuda:
        launches = [e for e in events if e.name.startswith(LAUNCH_CALLS)]
        kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
        attention = sorted({e.name[:80] for e in kernels if any(s in e.name.lower() for s in ATTENTION_NAMES)})
    else:
        launches, kernels, attention = top_level_ops(events), [], ["cpu"]
    verify, draft = (_spans(events, name) for name in (VERIFY, DRAFT))
    return {"unit": "kernel launches" if cuda else "operators called", "per_step": len(launches),
            "per_forward": _inside(launches, verify) / max(len(verify), 1), "forwards": len(verify),
            "per_draft": _inside(launches, draft) / max(len(draft), 1), "drafts": len(draft),
            "device_events": len(kernels) if cuda else None, "attention_kernels": attention,
            "captures": None if captured is None else engine.graph_captures - captured}


def _marked(inner, name: str):
    def marked(*args, **kwargs):
        with record_function(name):
            return inner(*args, **kwargs)
    return marked


def _spans(events, name: str) -> list[tuple[int, int]]:
    """The host's ranges of ``name``: on CUDA the profiler also reports each range on the
    device's timeline (a "gpu_user_annotation" of the same name), which lags the host."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.name == name and not str(e.device_type).endswith("CUDA")]


def _inside(launches, spans: list[tuple[int, int]]) -> int:
    """The launches whose host call starts inside one of ``spans``."""
    return sum(any(a <= e.time_range.start < b for a, b in spans) for e in launches)


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

"""The device check's timings (sections 3-5 of ``treespark.bench.device_check``): full-
batch decode steps split into the verify forward, the drafter backbone and the rest;
the served per-step allocator; the copy bandwidth behind the floor."""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import torch

from treespark.bench.device_pair import EAGER, CheckConfig, Forward, products_for, random_prompts
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.step_alloc import StepAllocator
from treespark.engine.step_costs import startup_step_costs
from treespark.models.pair import ModelPair
from treespark.spec.budget import Budget
from treespark.spec.params import SamplingParams, StepStats


# -- 3. throughput -----------------------------------------------------------------------
class StageClock:
    """Times the verify forward and the drafter backbone inside engine steps: CUDA events
    on GPU, perf_counter on CPU (wrapping the two calls on this engine's objects; each is
    the CUDA graphs' where the engine replays them)."""

    def __init__(self, engine: Engine) -> None:
        self.cuda = engine.device.type == "cuda"
        self.spans: dict[str, list] = {"verify": [], "backbone": []}
        self._wrap(engine.graphs if engine.graphs is not None else engine.runner, "forward", "verify")
        self._wrap(engine.draft_graphs if engine.draft_graphs is not None else engine.drafter, "block_logits",
                   "backbone")

    def _wrap(self, obj: Any, method: str, name: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = inner(*args, **kwargs)
                b.record()
                self.spans[name].append((a, b))
            else:
                t = time.perf_counter()
                out = inner(*args, **kwargs)
                self.spans[name].append(time.perf_counter() - t)
            return out

        setattr(obj, method, timed)

    def take(self) -> dict[str, float]:
        """Seconds of each span since the last take (the device must be idle)."""
        out = {}
        for name, spans in self.spans.items():
            out[name] = sum(a.elapsed_time(b) / 1e3 for a, b in spans) if self.cuda else sum(spans)
            spans.clear()
        return out


def timed_decode(pair: ModelPair, budget: Budget, batch: int, temperature: float, cfg: CheckConfig,
                 device: torch.device, allocator: StepAllocator | None = None,
                 prompt_len: int | None = None, forward: Forward = EAGER) -> dict[str, Any]:
    """Prefill ``batch`` requests, then time ``timed_steps`` decode steps that all run the
    full batch (max_tokens leaves every request running through the window), with
    ``forward``'s target forward (``captures``: CUDA-graph buckets, the verify forward's
    and the block pass's, captured inside the timed steps, None without graphs)."""
    plen = prompt_len or cfg.prompt_len
    blk = pair.drafter.config.block_size
    chunk = min(plen, 2048)
    steps = batch * -(-plen // chunk) + cfg.warm_steps + cfg.timed_steps + 4  # >= the steps any request decodes
    max_tokens = steps * (blk + 1)
    engine = Engine(pair, EngineConfig(max_batch_size=batch, max_context=plen + max_tokens + 8,
                                       max_tree_nodes=32, prefill_chunk=chunk, **forward.engine_args),
                    budget=budget, products=products_for(device))
    if allocator is not None:
        engine.set_allocator(allocator)
    engine.decode.measure_stages = True  # draft_s and verify_s below are device times
    for i, p in enumerate(random_prompts(batch, plen, pair.vocab_size, cfg.seed)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i))
    while engine.num_waiting:  # prefill: not timed (running rows decode meanwhile, untimed too)
        engine.step()
    assert engine.num_running == batch
    for _ in range(cfg.warm_steps):
        engine.step()
    clock = StageClock(engine)
    captured = engine.graph_captures
    stats: list[StepStats] = []
    engine.on_step = stats.append
    rows = []
    emitted = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(cfg.timed_steps):
        engine.decode.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            outs = engine.step()
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            engine.decode.sync()
            wall = time.perf_counter() - t0
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        spans = clock.take()
        emitted += sum(len(o.new_token_ids) for o in outs)
        s = stats[-1]
        assert s.batch_size == batch and not any(o.finished for o in outs), "a timed step ran a partial batch"
        rows.append({"step": wall, "verify": spans["verify"], "backbone": spans["backbone"],
                     "draft": s.draft_s, "walk": max(s.verify_s - spans["verify"], 0.0),
                     "rest": max(wall - spans["verify"] - spans["backbone"], 0.0),
                     "syncs": syncs if device.type == "cuda" else None, "copies": s.host_syncs,
                     "nodes": s.tokens_verified / batch})
    med = {k: statistics.median(r[k] for r in rows) for k in ("step", "verify", "backbone", "draft", "walk",
                                                              "rest", "nodes")}
    return {**med, "tokens_per_s": emitted / sum(r["step"] for r in rows),
            "syncs": max((r["syncs"] or 0) for r in rows) if device.type == "cuda" else None,
            "copies": max(r["copies"] for r in rows),
            "captures": None if captured is None else engine.graph_captures - captured,
            "peak_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None}


def served_allocator(pair: ModelPair, cfg: CheckConfig, device: torch.device) -> StepAllocator:
    """The per-step policy as a replica serves it: priced on a step-cost table measured
    here at startup (``startup_step_costs``, nothing cached)."""
    engine = Engine(pair, EngineConfig(max_batch_size=max(cfg.batch_sizes), max_context=cfg.prompt_len + 256,
                                       max_tree_nodes=32), products=products_for(device))
    table = startup_step_costs(engine, time_budget_s=cfg.policy_profile_s, cache_dir=None)
    return StepAllocator(table.step_costs(32))


# -- 4. and 5. -----------------------------------------------------------------------------
def read_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bytes per second of reading a large buffer once: a ``sum`` over ``nbytes`` of
    float32, the median of ``reps`` after one untimed. A forward at batch 1 reads its
    weights and writes almost nothing, so this, not a copy, is the limit it streams at."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    times = []
    for rep in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        src.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:
            times.append(time.perf_counter() - t0)
    return src.numel() * 4 / statistics.median(times)


def bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a large device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 5
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)

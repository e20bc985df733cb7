"""The one-shot device check: is this machine's engine correct, and what does a step cost?

``treespark device-check`` needs no network and nothing beyond the installed packages
(torch >= 2.11, transformers 5.x). It builds a random-weight Qwen3-4B-shaped target
and DSpark drafter straight on the device (on CPU, ``--device cpu``: the same
architecture at tiny widths, with the full 151,936-token vocabulary) and writes one
markdown report and one JSON under ``--out``:

1. **Preflight**: versions, the device, free memory, and which SDPA kernels attention
   actually runs (the CUDA profiler's kernel names; "cpu" on CPU).
2. **Correctness** (any failure makes the command exit non-zero):
   the runner's logits against the transformers model's own forward (max difference,
   argmax agreement); greedy chain and tree output against plain decoding (a
   divergence passes only at a near-tie of the plain path's logits, which rounding may
   break either way); every value finite; the drafter loader on a checkpoint written
   to disk in the public layout (sharded, with an index), drafting bit for bit what the
   drafter in memory drafts.
3. **Throughput** at each batch size and T = 0 / 1 for plain decoding, a chain of 4, a
   tree of 32 and the served per-step policy. Every timed step runs the full batch
   (all prompts are prefilled before the clock starts, and no request can finish
   inside the window). Per step: the verify forward and the drafter backbone (CUDA
   events on GPU, perf_counter on CPU), the rest of the step (host Python and the small
   device calls: the depth waves, the walk, the commit), and the synchronisations
   (on CUDA counted by ``torch.cuda.set_sync_debug_mode``; the engine's own count of
   device-to-host copies beside them).
4. **Long context**: verify step time and peak memory at long prompts.
5. **The floor**: the target's weight bytes over the measured memory bandwidth, beside
   plain decoding's step time at batch 1.

Random weights accept almost nothing, so tokens/s say what each policy costs here,
not what it gains (``treespark bench acceptance`` measures that on the real pair).
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from treespark.bench.common import markdown_table
from treespark.engine.core import Engine, EngineConfig
from treespark.engine.kv import KVStore
from treespark.engine.step_alloc import StepAllocator
from treespark.engine.step_costs import startup_step_costs
from treespark.engine.target import TargetRunner
from treespark.kernels.attention import DenseKV
from treespark.kernels.linear import F_LINEAR, ProductPlan
from treespark.models.checkpoint import INDEX_NAME, load_drafter
from treespark.models.drafter import DSparkConfig, DSparkDrafter
from treespark.models.pair import ModelPair, init_weights, pick_device
from treespark.spec.budget import Budget
from treespark.spec.params import SamplingParams, StepStats

Inject = Callable[[str, torch.Tensor], torch.Tensor]  # test hook: (point name, tensor) -> tensor


@dataclass(frozen=True)
class PairShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    drafter_layers: int
    tap_layers: tuple[int, ...]
    block_size: int = 7
    markov_rank: int = 256


QWEN3_4B = PairShape("qwen3-4b", vocab_size=151_936, hidden_size=2560, intermediate_size=9728, layers=36,
                     heads=32, kv_heads=8, head_dim=128, drafter_layers=5, tap_layers=(1, 9, 17, 25, 33))
TINY = PairShape("tiny", vocab_size=151_936, hidden_size=64, intermediate_size=128, layers=3, heads=4,
                 kv_heads=2, head_dim=16, drafter_layers=1, tap_layers=(0, 2), block_size=4, markov_rank=8)
SHAPES = {s.name: s for s in (QWEN3_4B, TINY)}


@dataclass(frozen=True)
class CheckConfig:
    shape: PairShape = QWEN3_4B
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompt_len: int = 128
    timed_steps: int = 16                 # full-batch steps timed per (T, batch, policy)
    warm_steps: int = 3
    greedy_prompts: int = 4               # requests whose greedy output is compared with plain decoding
    greedy_tokens: int = 32
    long_context: tuple[tuple[int, int], ...] = ((8, 4096), (32, 4096), (8, 8192), (32, 8192))  # (batch, tokens)
    policy_profile_s: float = 20.0        # the served policy's startup step-cost measurement
    bandwidth_bytes: int = 1 << 30
    full_size_checkpoint: bool = True     # the loader fixture at the drafter's real size (else: tiny)
    seed: int = 0

    @classmethod
    def cpu(cls) -> CheckConfig:
        """The tiny CPU run (well under a minute): the same sections at small sizes."""
        return cls(shape=TINY, batch_sizes=(1, 2), prompt_len=16, timed_steps=4, warm_steps=1, greedy_prompts=2,
                   greedy_tokens=12, long_context=((2, 512),), policy_profile_s=2.0, bandwidth_bytes=1 << 26)


POLICIES = {"plain": Budget.off(), "chain of 4": Budget.chain(4), "tree of 32": Budget(0.0, 32, 4)}
SERVED = "served per-step"


# -- the pair ----------------------------------------------------------------------------
def build_pair(shape: PairShape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> ModelPair:
    cfg = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=shape.intermediate_size, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      head_dim=shape.head_dim, max_position_embeddings=40_960, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    dcfg = DSparkConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.drafter_layers,
                        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                        head_dim=shape.head_dim, block_size=shape.block_size, target_layer_ids=shape.tap_layers,
                        mask_token_id=shape.vocab_size - 1, markov_rank=shape.markov_rank, rope_theta=1e6,
                        confidence_head=True, confidence_head_with_markov=True)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        target = Qwen3ForCausalLM(cfg).to(dtype)
        drafter = DSparkDrafter(dcfg).to(dtype)
    target.to_empty(device=device)
    init_weights(target, g)
    target.tie_weights()
    # the rotary frequencies are a buffer outside the weights: build them for real
    target.model.rotary_emb = type(target.model.rotary_emb)(cfg).to(device)
    drafter.to_empty(device=device)
    init_weights(drafter, g)
    return ModelPair(target=target.eval(), drafter=drafter.eval(), name=f"random-{shape.name}")


def _products(device: torch.device) -> ProductPlan | None:
    return ProductPlan.fixed(F_LINEAR) if device.type == "cpu" else None  # no per-machine timing on CPU


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


# -- 1. preflight ------------------------------------------------------------------------
def preflight(pair: ModelPair, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "device": str(device),
                           "dtype": str(next(pair.target.parameters()).dtype)}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out |= {"device_name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "free_gib": round(free / 2**30, 1), "total_gib": round(total / 2**30, 1),
                "sdpa_kernels": _sdpa_kernels(pair, device)}
    else:
        avail = _meminfo("MemAvailable")
        out |= {"device_name": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "free_gib": None if avail is None else round(avail / 2**30, 1), "sdpa_kernels": ["cpu"]}
    return out


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _sdpa_kernels(pair: ModelPair, device: torch.device) -> list[str]:
    """The attention kernels one tree-verify forward launches, by the profiler's names."""
    from torch.profiler import ProfilerActivity, profile

    runner = TargetRunner(pair.target, pair.drafter.config.target_layer_ids)
    k = 8
    store = KVStore(runner.store_shape, 1, 64, device, runner.dtype)
    pos = torch.arange(k, device=device)[None]
    mask = (torch.arange(64, device=device)[None, :] <= pos[0][:, None])[None, None]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(torch.ones(1, k, dtype=torch.long, device=device), pos, pos, store, slice(0, 1), mask)
        torch.cuda.synchronize(device)
    names = {e.key for e in prof.key_averages()}
    keys = ("flash", "fmha", "efficient", "attention", "cudnn", "sdpa", "softmax")
    found = sorted(n for n in names if any(s in n.lower() for s in keys))
    return found or ["math (no fused attention kernel seen)"]


# -- 2. correctness ----------------------------------------------------------------------
@dataclass
class Checks:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, ok: bool, value: str, bound: str) -> None:
        self.rows.append({"check": name, "ok": bool(ok), "value": value, "bound": bound})

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)


def check_logits(pair: ModelPair, device: torch.device, checks: Checks, inject: Inject | None, seed: int) -> None:
    """The runner's logits and taps against the transformers forward on the same weights."""
    exact = next(pair.target.parameters()).dtype == torch.float32
    (ids,) = _prompts(1, 48, pair.vocab_size, seed)
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        ref = pair.target(x).logits.float()
    runner = TargetRunner(pair.target, pair.drafter.config.target_layer_ids, _products(device))
    n = x.shape[1]
    store = KVStore(runner.store_shape, 1, n, device, runner.dtype)
    pos = torch.arange(n, device=device)[None]
    mask = (torch.arange(n, device=device)[None, :] <= pos[0][:, None])[None, None]
    out = runner.forward(x, pos, pos, store, slice(0, 1), mask)
    got = out.logits if inject is None else inject("runner_logits", out.logits)
    finite = bool(torch.isfinite(got).all() and torch.isfinite(ref).all() and torch.isfinite(out.taps).all())
    checks.add("runner and transformers logits finite", finite, str(finite), "True")
    diff = float((got - ref).abs().max())
    scale = float(ref.abs().max())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    tol = 1e-3 * max(scale, 1.0) if exact else 0.05 * max(scale, 1.0)
    checks.add("runner vs transformers: max |logit diff|", diff <= tol, f"{diff:.3g} (max |logit| {scale:.3g})",
               f"<= {tol:.3g}")
    need = 1.0 if exact else 0.95
    checks.add("runner vs transformers: argmax agreement", agree >= need, f"{agree:.4f}", f">= {need}")
    # the drafter on the runner's taps: finite block logits
    d = pair.drafter
    k, v = d.context_kv(out.taps.to(d.fc.weight.dtype), pos)
    u = d.block_logits(x[:, -1], DenseKV(k, v), torch.tensor([n], device=device))
    u = u if inject is None else inject("drafter_logits", u)
    checks.add("drafter block logits finite", bool(torch.isfinite(u).all()), str(bool(torch.isfinite(u).all())),
               "True")


def _generate(pair: ModelPair, prompts: list[list[int]], budget: Budget, tokens: int,
              device: torch.device) -> list[list[int]]:
    engine = Engine(pair, EngineConfig(max_batch_size=len(prompts), max_context=len(prompts[0]) + tokens + 8,
                                       max_tree_nodes=32), budget=budget, products=_products(device))
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=tokens, seed=i))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"g{i}"] for i in range(len(prompts))]


def check_greedy(pair: ModelPair, device: torch.device, cfg: CheckConfig, checks: Checks) -> dict[str, Any]:
    """Greedy chain and tree output against plain decoding. A divergence passes only where
    the plain path's top two logits (transformers forward) are within rounding."""
    exact = next(pair.target.parameters()).dtype == torch.float32
    tie = 1e-3 if exact else 0.25
    prompts = _prompts(cfg.greedy_prompts, 24, pair.vocab_size, cfg.seed + 1)
    plain = _generate(pair, prompts, Budget.off(), cfg.greedy_tokens, device)
    report = {}
    for name in ("chain of 4", "tree of 32"):
        outs = _generate(pair, prompts, POLICIES[name], cfg.greedy_tokens, device)
        same = sum(o == p for o, p in zip(outs, plain, strict=True))
        first, margins = None, []
        for prompt, o, p in zip(prompts, outs, plain, strict=True):
            j = next((i for i, (a, b) in enumerate(zip(o, p, strict=False)) if a != b), None)
            if j is None:
                continue
            first = j if first is None else min(first, j)
            with torch.no_grad():
                logits = pair.target(torch.tensor([prompt + p[:j]], device=device)).logits[0, -1].float()
            margins.append(float(logits[p[j]] - logits[o[j]]))
        ok = all(abs(m) <= tie for m in margins)
        report[name] = {"matched": same, "of": len(prompts), "first_divergence": first, "margins": margins}
        worst = max((abs(m) for m in margins), default=0.0)
        checks.add(f"greedy {name} = plain decoding", ok,
                   f"{same}/{len(prompts)} identical; first divergence {first}; worst margin {worst:.3g}",
                   f"divergences only at near-ties (|margin| <= {tie})")
    return report


def write_public_checkpoint(drafter: DSparkDrafter, directory: Path, shards: int = 2) -> None:
    """``drafter`` in the public DSpark layout: a Qwen3DSparkModel config with the DSpark
    keys at the top level, tensors in ``shards`` safetensors files with an index."""
    c = drafter.config
    config = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
              "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}, "hidden_act": "silu",
              "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
              "block_size": c.block_size, "target_layer_ids": list(c.target_layer_ids),
              "mask_token_id": c.mask_token_id, "markov_rank": c.markov_rank, "markov_head_type": "vanilla",
              "enable_confidence_head": c.confidence_head, "confidence_head_with_markov": c.confidence_head_with_markov,
              "tie_word_embeddings": False}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: state[k] for k in part}, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def check_loader(pair: ModelPair, device: torch.device, cfg: CheckConfig, checks: Checks) -> dict[str, Any]:
    """Write the drafter in the public layout to disk, load it back on the device, and
    draft with both: bit for bit the same block logits."""
    dtype = pair.drafter.fc.weight.dtype
    source = pair.drafter
    if not cfg.full_size_checkpoint or device.type == "cpu":
        small = replace(source.config, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_hidden_layers=1, target_hidden_size=0)
        with torch.device(device):
            source = DSparkDrafter(small).to(dtype)
        init_weights(source, torch.Generator(device=device).manual_seed(cfg.seed))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_public_checkpoint(source, Path(tmp))
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        loaded = load_drafter(tmp, device=device, dtype=dtype)
    secs = time.perf_counter() - t0
    c = source.config
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    taps = torch.randn(1, 24, c.context_size, generator=g, device=device, dtype=dtype)
    pos = torch.arange(24, device=device)[None]
    outs = []
    for d in (source, loaded):
        k, v = d.context_kv(taps, pos)
        outs.append(d.block_logits(torch.tensor([5], device=device), DenseKV(k, v),
                                   torch.tensor([24], device=device)))
    # the same values in the same dtype: only the kernels' paths may differ (memory alignment)
    diff = float((outs[0] - outs[1]).abs().max())
    tol = (1e-4 if dtype == torch.float32 else 2e-2) * max(float(outs[0].abs().max()), 1.0)
    same = (bool(torch.isfinite(outs[1]).all()) and diff <= tol
            and bool(torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))))
    checks.add("loader: public layout (2 shards + index) drafts as in memory", same,
               f"{size / 2**30:.2f} GiB written and loaded in {secs:.1f} s; max |diff| {diff:.2g}",
               f"same argmax, max |diff| <= {tol:.2g}")
    return {"bytes": size, "seconds": round(secs, 2), "max_diff": diff, "same": same}


# -- 3. throughput -----------------------------------------------------------------------
class StageClock:
    """Times the verify forward and the drafter backbone inside engine steps: CUDA events
    on GPU, perf_counter on CPU (wrapping the two calls on this engine's objects)."""

    def __init__(self, engine: Engine) -> None:
        self.cuda = engine.device.type == "cuda"
        self.spans: dict[str, list] = {"verify": [], "backbone": []}
        self._wrap(engine.runner, "forward", "verify")
        self._wrap(engine.drafter, "block_logits", "backbone")

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
                 prompt_len: int | None = None) -> dict[str, Any]:
    """Prefill ``batch`` requests, then time ``timed_steps`` decode steps that all run the
    full batch (max_tokens leaves every request running through the window)."""
    plen = prompt_len or cfg.prompt_len
    blk = pair.drafter.config.block_size
    chunk = min(plen, 2048)
    steps = batch * -(-plen // chunk) + cfg.warm_steps + cfg.timed_steps + 4  # >= the steps any request decodes
    max_tokens = steps * (blk + 1)
    engine = Engine(pair, EngineConfig(max_batch_size=batch, max_context=plen + max_tokens + 8,
                                       max_tree_nodes=32, prefill_chunk=chunk),
                    budget=budget, products=_products(device))
    if allocator is not None:
        engine.set_allocator(allocator)
    engine.measure_stages = True  # draft_s and verify_s below are device times
    for i, p in enumerate(_prompts(batch, plen, pair.vocab_size, cfg.seed)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i))
    while engine.num_waiting:  # prefill: not timed (running rows decode meanwhile, untimed too)
        engine.step()
    assert engine.num_running == batch
    for _ in range(cfg.warm_steps):
        engine.step()
    clock = StageClock(engine)
    stats: list[StepStats] = []
    engine.on_step = stats.append
    rows = []
    emitted = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(cfg.timed_steps):
        engine.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            outs = engine.step()
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            engine.sync()
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
            "peak_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None}


def served_allocator(pair: ModelPair, cfg: CheckConfig, device: torch.device) -> StepAllocator:
    """The per-step policy as a replica serves it: priced on a step-cost table measured
    here at startup (``startup_step_costs``, nothing cached)."""
    engine = Engine(pair, EngineConfig(max_batch_size=max(cfg.batch_sizes), max_context=cfg.prompt_len + 256,
                                       max_tree_nodes=32), products=_products(device))
    table = startup_step_costs(engine, time_budget_s=cfg.policy_profile_s, cache_dir=None)
    return StepAllocator(table.step_costs(32))


# -- 4. and 5. -----------------------------------------------------------------------------
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


# -- the run -------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def device_check(config: CheckConfig, out_dir: str | Path, *, device: str | None = None,
                 log: Callable[[str], None] = print, inject: Inject | None = None) -> dict[str, Any]:
    """Run the check; writes ``device-check.md`` and ``device-check.json`` to ``out_dir``
    and returns the JSON dict (``ok``: every correctness check passed). ``inject``: a
    test hook that may alter named tensors (``runner_logits``, ``drafter_logits``)."""
    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pair = build_pair(config.shape, dev, dtype, config.seed)
    log(f"{config.shape.name} pair built on {dev} ({dtype}) in {time.perf_counter() - t_start:.1f} s")
    result: dict[str, Any] = {"config": asdict(config), "preflight": preflight(pair, dev)}
    log(f"preflight: {result['preflight']}")

    checks = Checks()
    check_logits(pair, dev, checks, inject, config.seed)
    result["greedy"] = check_greedy(pair, dev, config, checks)
    result["loader"] = check_loader(pair, dev, config, checks)
    result["checks"] = checks.rows
    result["ok"] = checks.ok
    for r in checks.rows:
        log(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']}: {r['value']} ({r['bound']})")

    t1 = time.perf_counter()
    allocator = served_allocator(pair, config, dev)
    log(f"served policy's step costs measured in {time.perf_counter() - t1:.1f} s")
    policies: dict[str, Budget] = {**POLICIES, SERVED: Budget.adaptive()}
    throughput = []
    for t in config.temperatures:
        for bs in config.batch_sizes:
            for name, budget in policies.items():
                r = timed_decode(pair, budget, bs, t, config, dev, allocator if name == SERVED else None)
                throughput.append({"T": t, "batch": bs, "policy": name, **r})
                log(f"T={t:g} batch={bs} {name}: {r['tokens_per_s']:.1f} tok/s, step {_ms(r['step'])} ms")
    result["throughput"] = throughput

    long_rows = []
    for bs, ctx in config.long_context:
        r = timed_decode(pair, POLICIES["tree of 32"], bs, 0.0, replace(config, timed_steps=min(config.timed_steps, 4)),
                         dev, prompt_len=ctx)
        long_rows.append({"batch": bs, "context": ctx, "verify_s": r["verify"], "step_s": r["step"],
                          "peak_gib": r["peak_gib"]})
        log(f"long context batch={bs} ctx={ctx}: verify {_ms(r['verify'])} ms")
    result["long_context"] = long_rows

    weight_bytes = sum(p.numel() * p.element_size() for p in pair.target.parameters())
    bw = bandwidth(dev, config.bandwidth_bytes)
    plain1 = next((r["step"] for r in throughput if r["policy"] == "plain" and r["batch"] == min(config.batch_sizes)
                   and r["T"] == 0), None)
    result["floor"] = {"weight_bytes": weight_bytes, "bandwidth_gb_s": bw / 1e9, "floor_s": weight_bytes / bw,
                       "plain_step_s": plain1}
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "device-check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "device-check.md").write_text(render(result))
    return result


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a markdown table cell


def render(r: dict[str, Any]) -> str:
    cfg, pre = r["config"], r["preflight"]
    lines = [f"# Device check: {cfg['shape']['name']} shapes, random weights, on {pre['device_name']} "
             f"({pre['dtype']})", "",
             f"`treespark device-check`: {'PASSED' if r['ok'] else 'FAILED'} in {r['seconds']:.0f} s.", "",
             "## Preflight", ""]
    lines += [f"- {k}: {v}" for k, v in pre.items()]
    lines += ["", "## Correctness", "", markdown_table(
        ["check", "result", "value", "bound"],
        [[_cell(c["check"]), "ok" if c["ok"] else "**FAIL**", _cell(c["value"]), _cell(c["bound"])]
         for c in r["checks"]])]
    lines += ["", "## Throughput", "",
              f"{cfg['timed_steps']} timed steps per row, every one at the full batch, after "
              f"{cfg['prompt_len']}-token prompts; medians per step in ms. verify: the target forward; backbone: "
              "the drafter's block pass; draft: the whole drafting stage (backbone and depth waves); walk: "
              "verification after the forward (acceptance, commit); rest: the step less verify and backbone "
              "(host Python and the small device calls); syncs: synchronisations seen by "
              "`torch.cuda.set_sync_debug_mode` (CUDA only); copies: the engine's own count of device-to-host "
              "copies and waits.", "",
              markdown_table(["T", "batch", "policy", "tokens/s", "step", "verify", "backbone", "draft", "walk",
                              "rest", "syncs", "copies", "nodes/row"],
                             [[f"{t['T']:g}", str(t["batch"]), t["policy"], f"{t['tokens_per_s']:.1f}",
                               _ms(t["step"]), _ms(t["verify"]), _ms(t["backbone"]), _ms(t["draft"]),
                               _ms(t["walk"]), _ms(t["rest"]), "-" if t["syncs"] is None else str(t["syncs"]),
                               str(t["copies"]), f"{t['nodes']:.1f}"] for t in r["throughput"]])]
    lines += ["", "## Long context", "", "A tree of 32 at T = 0 after long prompts.", "",
              markdown_table(["batch", "context", "verify ms", "step ms", "peak GiB"],
                             [[str(x["batch"]), str(x["context"]), _ms(x["verify_s"]), _ms(x["step_s"]),
                               "-" if x["peak_gib"] is None else f"{x['peak_gib']:.1f}"]
                              for x in r["long_context"]])]
    f = r["floor"]
    lines += ["", "## The floor", "",
              f"Target weights {f['weight_bytes'] / 2**30:.2f} GiB over a measured copy bandwidth of "
              f"{f['bandwidth_gb_s']:.1f} GB/s: a decode step cannot take less than {_ms(f['floor_s'])} ms. "
              f"Plain decoding's step at batch {min(cfg['batch_sizes'])}: {_ms(f['plain_step_s'])} ms.", ""]
    return "\n".join(lines)

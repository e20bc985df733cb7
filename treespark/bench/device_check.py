"""The one-shot device check: the GPU pair's shapes with random weights, no downloads.

``treespark device-check`` builds a random-weight Qwen3-4B-shaped target and a
DSpark-shaped drafter straight on the device (on the meta device first, so nothing is
materialised twice), then for T = 0 and T = 1 at batch 1, 8 and 32 decodes with plain
decoding, a chain and a tree, and prints tokens/s, the per-stage step times (drafting:
the backbone pass and the depth waves; verification: the target forward, the walk and
the commit), host syncs and the numbers copied to the host per step. Last it measures
the verify-forward cost model T(bs, k) and writes it beside the tables, for the pricing.

Random weights accept almost nothing, so the tokens/s say what each policy costs on
this hardware, not what it gains: acceptance is the drafter's business
(``treespark bench acceptance`` on the real pair). Stage times are device times (the
engine waits for the device at stage ends on CUDA).

The drafter's layer count and tap layers are assumptions (``QWEN3_4B``): the public
checkpoint's layout fixes its widths, block size 7 and Markov rank 256.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from treespark.bench.common import markdown_table
from treespark.engine.core import Engine, EngineConfig
from treespark.engine.cost_measure import MeasureConfig, measure_cost_model
from treespark.models.drafter import DSparkConfig, DSparkDrafter
from treespark.models.pair import ModelPair, init_weights, pick_device
from treespark.spec.budget import Budget
from treespark.spec.params import SamplingParams, StepStats


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
TINY = PairShape("tiny", vocab_size=1024, hidden_size=64, intermediate_size=128, layers=3, heads=4,
                 kv_heads=2, head_dim=16, drafter_layers=1, tap_layers=(0, 2), block_size=4, markov_rank=8)
SHAPES = {s.name: s for s in (QWEN3_4B, TINY)}

POLICIES = {"plain": Budget.off(), "chain of 4": Budget.chain(4), "tree of 32": Budget(0.0, 32, 4)}


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
                        mask_token_id=shape.vocab_size - 1, markov_rank=shape.markov_rank)
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


def _decode(pair: ModelPair, budget: Budget, batch: int, temperature: float, prompt_len: int,
            new_tokens: int, seed: int) -> tuple[list[StepStats], float, int]:
    """``batch`` requests decoded together; returns the decode steps' stats, the decode
    wall time and the tokens they emitted."""
    engine = Engine(pair, EngineConfig(max_batch_size=batch, max_context=prompt_len + new_tokens + 64),
                    budget=budget)
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(1, pair.vocab_size - 1, (prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=temperature, max_tokens=new_tokens,
                                                           seed=seed + i))
    while engine.num_waiting:  # prefill every request first
        engine.step()
        if not engine.has_unfinished():
            break
    stats: list[StepStats] = []
    engine.on_step = stats.append
    engine.sync()
    t0 = time.perf_counter()
    emitted = 0
    while engine.has_unfinished():
        emitted += sum(len(o.new_token_ids) for o in engine.step())
    engine.sync()
    return stats, time.perf_counter() - t0, emitted


@dataclass(frozen=True)
class CheckConfig:
    shape: PairShape = QWEN3_4B
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompt_len: int = 128
    new_tokens: int = 32
    cost_grid: MeasureConfig = MeasureConfig(batch_sizes=(1, 2, 4, 8, 16, 32), tokens=(1, 2, 4, 8, 16, 32, 64),
                                             context=512, repeats=3, max_step_tokens=4096)
    seed: int = 0


def device_check(config: CheckConfig, out_dir: str | Path, *, device: str | None = None, log=print) -> str:
    """Run the check; writes ``device-check.md`` and ``costmodel.json`` to ``out_dir``
    and returns the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    pair = build_pair(config.shape, dev, dtype, config.seed)
    log(f"{config.shape.name} pair built on {hw} ({dtype}) in {time.perf_counter() - t0:.1f} s")
    rows = []
    for t in config.temperatures:
        for bs in config.batch_sizes:
            plain_tps = None
            for name, budget in POLICIES.items():
                _decode(pair, budget, bs, t, config.prompt_len, 4, config.seed)  # warm-up
                stats, secs, emitted = _decode(pair, budget, bs, t, config.prompt_len, config.new_tokens,
                                               config.seed)
                tps = emitted / secs
                plain_tps = plain_tps or tps
                med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
                step, draft, verify = (med([getattr(s, f) for s in stats]) for f in ("step_s", "draft_s", "verify_s"))
                other = med([s.step_s - s.draft_s - s.verify_s for s in stats])
                rows.append([f"{t:g}", str(bs), name, f"{tps:.1f}", f"{tps / plain_tps:.2f}x", f"{step:.1f}",
                             f"{draft:.1f}", f"{verify:.1f}", f"{other:.1f}",
                             f"{statistics.mean(s.draft_waves for s in stats):.1f}",
                             f"{max(s.host_syncs for s in stats)}", f"{max(s.host_elements for s in stats)}",
                             f"{statistics.mean(sum(s.tree_sizes) / len(s.tree_sizes) for s in stats):.1f}"])
                log(" | ".join(rows[-1]))
    table = markdown_table(["T", "batch", "policy", "tokens/s", "vs plain", "step ms", "draft ms", "verify ms",
                            "other ms", "waves", "syncs", "host numbers", "nodes/row"], rows)
    t1 = time.perf_counter()
    cost = measure_cost_model(pair.target, config.cost_grid, name=f"random-{config.shape.name} on {hw}",
                              tap_layers=config.shape.tap_layers)
    cost.save(out / "costmodel.json")
    log(f"cost model T(bs, k) measured in {time.perf_counter() - t1:.0f} s -> {out / 'costmodel.json'}")
    text = (f"# Device check: {config.shape.name} shapes, random weights, on {hw} ({dtype})\n\n"
            f"`treespark device-check --shape {config.shape.name}`; {config.new_tokens} new tokens per request "
            f"after {config.prompt_len}-token prompts, medians over the decode steps. Shapes: "
            f"`{json.dumps(asdict(config.shape))}`.\n\n{table}\n\n"
            f"Cost model T(bs, k): `costmodel.json` beside this file. Total {time.perf_counter() - t0:.0f} s.\n")
    (out / "device-check.md").write_text(text)
    return text

"""The device check's preflight and correctness checks (sections 1 and 2 of
``treespark.bench.device_check``): each check adds a row to ``Checks``; any failed row
makes the command exit non-zero."""

from __future__ import annotations

import json
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

from treespark.bench.attention import PagedScene, paged_scene, random_trees
from treespark.bench.device_pair import (
    EAGER,
    POLICIES,
    CheckConfig,
    Forward,
    products_for,
    random_prompts,
)
from treespark.engine.attend import PagedContext
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.draft_graphs import GraphedDraft, draft_buckets
from treespark.engine.graphs import Buckets, GraphedForward
from treespark.engine.kv import KVStore, StoreShape
from treespark.engine.target import TargetRunner
from treespark.kernels.attention import DenseKV
from treespark.models.checkpoint import INDEX_NAME, load_drafter
from treespark.models.drafter import DSparkDrafter
from treespark.models.pair import ModelPair, init_weights
from treespark.spec.budget import Budget
from treespark.spec.gumbel import keyed_argmax, keyed_uniforms, position_keys
from treespark.spec.params import SamplingParams
from treespark.spec.tree import tree_batch

Inject = Callable[[str, torch.Tensor], torch.Tensor]  # test hook: (point name, tensor) -> tensor


# -- 1. preflight ------------------------------------------------------------------------
def preflight(pair: ModelPair, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "device": str(device),
                           "dtype": str(next(pair.target.parameters()).dtype)}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out |= {"device_name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "free_gib": round(free / 2**30, 1), "total_gib": round(total / 2**30, 1)}
    else:
        avail = _meminfo("MemAvailable")
        out |= {"device_name": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "free_gib": None if avail is None else round(avail / 2**30, 1)}
    return out


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- 2. correctness ----------------------------------------------------------------------
@dataclass
class Checks:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, ok: bool, value: str, bound: str) -> None:
        self.rows.append({"check": name, "ok": bool(ok), "value": value, "bound": bound})

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)


def check_logits(pair: ModelPair, device: torch.device, checks: Checks, inject: Inject | None, seed: int,
                 forward: Forward = EAGER) -> None:
    """The runner's logits and taps against the transformers forward on the same weights
    (the runner's layer ops compiled with ``forward.compile_backend``); with CUDA graphs,
    ``check_graph_logits`` too. Rows name a forward other than eager."""
    backend = forward.compile_backend
    mode = "" if forward == EAGER else f" ({forward.name})"
    exact = next(pair.target.parameters()).dtype == torch.float32
    (ids,) = random_prompts(1, 48, pair.vocab_size, seed)
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        ref = pair.target(x).logits.float()
    runner = TargetRunner(pair.target, pair.drafter.config.target_layer_ids, products_for(device),
                          compile_backend=backend)
    n = x.shape[1]
    store = KVStore(runner.store_shape, 1, n, device, runner.dtype)
    pos = torch.arange(n, device=device)[None]
    mask = (torch.arange(n, device=device)[None, :] <= pos[0][:, None])[None, None]
    out = runner.forward(x, pos, pos, store, slice(0, 1), mask)
    got = out.logits if inject is None else inject("runner_logits", out.logits)
    finite = bool(torch.isfinite(got).all() and torch.isfinite(ref).all() and torch.isfinite(out.taps).all())
    checks.add(f"runner and transformers logits finite{mode}", finite, str(finite), "True")
    _agreement(checks, "runner vs transformers", mode, ref, got, exact, f"max |logit| {float(ref.abs().max()):.3g}")
    # the drafter on the runner's taps: finite block logits
    d = pair.drafter
    k, v = d.context_kv(out.taps.to(d.fc.weight.dtype), pos)
    u = d.block_logits(x[:, -1], DenseKV(k, v), torch.tensor([n], device=device))
    u = u if inject is None else inject("drafter_logits", u)
    checks.add(f"drafter block logits finite{mode}", bool(torch.isfinite(u).all()), str(bool(torch.isfinite(u).all())),
               "True")
    if forward.cuda_graphs:
        check_graph_logits(pair, runner, checks, seed, mode)


def check_graph_logits(pair: ModelPair, runner: TargetRunner, checks: Checks, seed: int, mode: str) -> None:
    """The verify forward replayed from CUDA graphs (on CPU: padded, eager) against the
    runner's own forward on one paged store (shuffled blocks, rows of different lengths,
    padded trees): two batches of one bucket, so the second is a replay on new inputs.
    Each batch runs from the same store contents on both paths."""
    device = runner.device
    exact = runner.dtype == torch.float32
    c = pair.drafter.config
    bs = 16
    scene = paged_scene(runner, StoreShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim), [37, 5, 70],
                        nodes=9, block_size=bs, seed=seed)
    # both batches in bucket (4 rows, 16 tokens, 8 blocks): 3 rows, 9 then 12 nodes, 79 then 76 keys
    second = [30, 3, 64]
    batches = [(scene.trees, scene.lengths),
               (random_trees(second, 12, runner.vocab_size, np.random.default_rng(seed + 1)), second)]
    store = scene.kv.target
    k0, v0 = store.k.clone(), store.v.clone()
    graphed = GraphedForward(runner, store, bs, Buckets.up_to(4, 16, 8))
    refs, gots = [], []
    for trees, lengths in batches:
        b = tree_batch(trees, lengths, device)
        rows = scene.kv.rows(scene.table, b.mask.shape[-1])
        out = []
        for path in ("eager", "graphed"):
            store.k.copy_(k0)
            store.v.copy_(v0)
            if path == "eager":
                got = runner.forward(b.tokens, b.positions, b.write_pos, store, rows, b.mask)
            else:
                got = graphed.forward(b.tokens, b.positions, b.write_pos, rows, b.mask)
            out.append(got.logits)
        refs.append(out[0].flatten(0, 1))
        gots.append(out[1].flatten(0, 1))
    ref, got = torch.cat(refs), torch.cat(gots)
    finite = bool(torch.isfinite(got).all())
    checks.add(f"graphed verify forward: logits finite{mode}", finite, str(finite), "True")
    _agreement(checks, "graphed vs eager verify forward", mode, ref, got, exact,
               f"2 batches of one bucket, {graphed.captures} captured")
    check_graph_draft(pair, scene, checks, seed, mode)


def check_graph_draft(pair: ModelPair, scene: PagedScene, checks: Checks, seed: int, mode: str) -> None:
    """The drafter's block pass replayed from CUDA graphs (on CPU: padded, eager) against
    its own pass over the scene's drafter store: two batches of one bucket (3 rows, 5
    context blocks; the second a replay on new anchors and lengths)."""
    d, store, bs = pair.drafter, scene.kv.drafter, scene.kv.block_size
    device, blk = scene.table.device, d.config.block_size
    exact = store.k.dtype == torch.float32
    rng = np.random.default_rng(seed + 2)
    graphed = GraphedDraft(d, store, bs, draft_buckets(4, blk, 128, bs))
    refs, gots = [], []
    for lengths in (scene.lengths, [30, 3, 64]):
        anchors = torch.tensor(rng.integers(d.config.vocab_size, size=len(lengths)).tolist(), device=device)
        lens = torch.tensor(lengths, device=device)
        context = PagedContext(store, scene.table, bs, max(lengths))
        refs.append(d.block_logits(anchors, context, lens).flatten(0, 1))
        gots.append(graphed.block_logits(anchors, context, lens).flatten(0, 1))
    ref, got = torch.cat(refs), torch.cat(gots)
    finite = bool(torch.isfinite(got).all())
    checks.add(f"graphed drafter block: logits finite{mode}", finite, str(finite), "True")
    _agreement(checks, "graphed vs eager drafter block", mode, ref, got, exact,
               f"2 batches of one bucket, {graphed.captures} captured")


def _agreement(checks: Checks, what: str, mode: str, ref: torch.Tensor, got: torch.Tensor, exact: bool,
               detail: str) -> None:
    """Two checks of ``got``'s logits against ``ref``'s: the largest difference (1e-3 of
    the largest logit in float32, 5 % in bf16; ``detail`` beside its value), and the
    argmax. In float32 every argmax must agree. In bf16 a compiled or padded forward
    changes the products' shapes and so their rounding, and random weights leave many
    near-ties: an argmax may flip, but only where ``ref``'s two logits are within the two
    differences (2 x the largest)."""
    diff, scale = float((got - ref).abs().max()), float(ref.abs().max())
    tol = 1e-3 * max(scale, 1.0) if exact else 0.05 * max(scale, 1.0)
    checks.add(f"{what}: max |logit diff|{mode}", diff <= tol, f"{diff:.3g} ({detail})", f"<= {tol:.3g}")
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    margin = disagreement_margin(ref, got)
    tie = 0.0 if exact else 2 * diff
    checks.add(f"{what}: argmax agreement{mode}", margin <= tie, f"{agree:.4f}; worst margin {margin:.3g}",
               "1.0" if exact else f"disagreements only at near-ties (reference margin <= {tie:.3g})")


def disagreement_margin(ref: torch.Tensor, got: torch.Tensor) -> float:
    """The largest margin, in ``ref``'s logits, by which ``ref`` prefers its own argmax
    to ``got``'s at a position where the two disagree (0.0 where they agree everywhere):
    how far from a tie the worst flip was."""
    best = ref.max(-1).values
    theirs = ref.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
    return float((best - theirs).max())


def _generate(pair: ModelPair, prompts: list[list[int]], budget: Budget, tokens: int,
              device: torch.device, forward: Forward = EAGER) -> list[list[int]]:
    engine = Engine(pair, EngineConfig(max_batch_size=len(prompts), max_context=len(prompts[0]) + tokens + 8,
                                       max_tree_nodes=32, **forward.engine_args),
                    budget=budget, products=products_for(device))
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=tokens, seed=i))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"g{i}"] for i in range(len(prompts))]


def check_greedy(pair: ModelPair, device: torch.device, cfg: CheckConfig, checks: Checks,
                 forward: Forward = EAGER) -> dict[str, Any]:
    """Greedy chain and tree output against plain decoding (all three with ``forward``'s
    target forward). A divergence passes only where the plain path's top two logits
    (transformers forward) are within rounding."""
    mode = "" if forward == EAGER else f" ({forward.name})"
    exact = next(pair.target.parameters()).dtype == torch.float32
    tie = 1e-3 if exact else 0.25
    prompts = random_prompts(cfg.greedy_prompts, 24, pair.vocab_size, cfg.seed + 1)
    plain = _generate(pair, prompts, Budget.off(), cfg.greedy_tokens, device, forward)
    report = {}
    for name in ("chain of 4", "tree of 32"):
        outs = _generate(pair, prompts, POLICIES[name], cfg.greedy_tokens, device, forward)
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
        report[name + mode] = {"matched": same, "of": len(prompts), "first_divergence": first, "margins": margins}
        worst = max((abs(m) for m in margins), default=0.0)
        checks.add(f"greedy {name} = plain decoding{mode}", ok,
                   f"{same}/{len(prompts)} identical; first divergence {first}; worst margin {worst:.3g}",
                   f"divergences only at near-ties (|margin| <= {tie})")
    return report


def check_keyed_noise(device: torch.device, vocab: int, checks: Checks, seed: int) -> dict[str, Any]:
    """The position-keyed noise of reproducible requests (``treespark.spec.gumbel``) on the
    device against the CPU's, bit for bit: 64 (seed, index) keys over the whole vocabulary,
    and the keyed draw from the same logits."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 2**32, (64, 2), generator=g)
    index = torch.randint(0, 2**20, (64,), generator=g)
    logits = torch.randn(64, vocab, generator=g) * 4
    t = torch.full((64,), 0.8, dtype=torch.float64)
    out = {}
    for dev in (torch.device("cpu"), device):
        keys = position_keys(words[:, 0].to(dev), words[:, 1].to(dev), index.to(dev))
        u = keyed_uniforms(keys, torch.arange(vocab, device=dev)).cpu()
        x = keyed_argmax(logits.to(dev), t.to(dev), None, keys, torch.arange(64, device=dev)).cpu()
        out[dev.type] = (u, x)
    (u_cpu, x_cpu), (u_dev, x_dev) = out["cpu"], out[device.type]
    same = torch.equal(u_cpu, u_dev) and torch.equal(x_cpu, x_dev)
    differ = int((u_cpu != u_dev).sum())
    checks.add("keyed noise and draws: device = CPU, bit for bit", same,
               f"{differ} of {u_cpu.numel()} uniforms differ; draws {'equal' if torch.equal(x_cpu, x_dev) else 'differ'}",
               "0 differ, draws equal")
    return {"uniforms": u_cpu.numel(), "differ": differ}


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

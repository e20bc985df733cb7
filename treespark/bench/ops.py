"""How many operators does one target forward launch, fused and not, and what does
fusing do to plain decoding's speed?

Two runners over the same model and product plan, side by side in one run:
``TargetRunner(fused=False)``, the reference (seven products a layer, transformers'
RMSNorm modules, ``rotate_half``), and the default fused forward (four products a
layer, ``F.rms_norm``, one rope over q and k). Operators are counted with
``torch.profiler`` over one forward after a warm-up: *called* = the operators the
forward's Python calls (``aten::``, ``mkldnn::``, ...; an operator called from inside
another is not counted again), *all* = every operator event, those nested in composites
included (on CPU ``F.rms_norm`` is such a composite: one call, several kernels). Two
shapes: decoding at batch 1 (1 token after a 64-token context), and a verify forward
at batch 8 x an 8-node tree. Goodput is plain greedy decoding through the runner
alone (no drafter, no engine): rows x new tokens / seconds after a batched prefill,
the median of ``repeats`` runs, reference and fused interleaved.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from treespark.bench.common import markdown_table
from treespark.engine.kv import KVStore
from treespark.engine.products import product_plan
from treespark.engine.target import TargetRunner
from treespark.models.pair import ModelPair

CONTEXT = 64
TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 3, 5)   # the 8-node tree of the batch-8 verify forward


@dataclass(frozen=True)
class OpCount:
    called: int   # operators called by the profiled code itself
    total: int    # every operator event, nested ones included


def count_ops(fn: Callable[[], object]) -> OpCount:
    """The operators ``fn()`` launches on this thread, counted by ``torch.profiler``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = [e for e in prof.events() if "::" in e.name]

    def nested(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if "::" in p.name:
                return True
            p = p.cpu_parent
        return False

    return OpCount(sum(not nested(e) for e in ops), len(ops))


def _tree_mask(parents: tuple[int, ...], context: int) -> torch.Tensor:
    """[K, context + K] bool: each node sees the context, itself and its ancestors."""
    k = len(parents)
    mask = torch.zeros(k, context + k, dtype=torch.bool)
    mask[:, :context] = True
    for i in range(k):
        j = i
        while j >= 0:
            mask[i, context + j] = True
            j = parents[j]
    return mask


def _depths(parents: tuple[int, ...]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def _verify_call(runner: TargetRunner, batch: int, parents: tuple[int, ...], vocab: int):
    """A prefilled store and a closure running one verify forward of ``batch`` rows x
    the tree ``parents`` after ``CONTEXT`` tokens; returns (closure, logits of one call)."""
    g = torch.Generator().manual_seed(0)
    k = len(parents)
    store = KVStore(runner.store_shape, batch, CONTEXT + k, runner.device, runner.dtype)
    ctx = torch.randint(0, vocab, (batch, CONTEXT), generator=g)
    pos = torch.arange(CONTEXT).expand(batch, -1)
    causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril()[None, None]
    runner.forward(ctx, pos, pos, store, slice(0, batch), causal, logits_for="none")
    tokens = torch.randint(0, vocab, (batch, k), generator=g)
    positions = (CONTEXT + torch.tensor(_depths(parents))).expand(batch, -1)
    write = torch.arange(CONTEXT, CONTEXT + k).expand(batch, -1)
    mask = _tree_mask(parents, CONTEXT)[None, None].expand(batch, 1, -1, -1)

    def call() -> torch.Tensor:
        return runner.forward(tokens, positions, write, store, slice(0, batch), mask).logits

    return call, call()


def decode_goodput(runner: TargetRunner, batch: int, new_tokens: int, vocab: int) -> tuple[float, list[list[int]]]:
    """Plain greedy decoding of ``batch`` rows for ``new_tokens`` after a ``CONTEXT``-token
    prompt: tokens per second (decode steps only) and the tokens."""
    g = torch.Generator().manual_seed(1)
    store = KVStore(runner.store_shape, batch, CONTEXT + new_tokens, runner.device, runner.dtype)
    prompt = torch.randint(0, vocab, (batch, CONTEXT), generator=g)
    pos = torch.arange(CONTEXT).expand(batch, -1)
    causal = torch.ones(CONTEXT, CONTEXT + new_tokens, dtype=torch.bool).tril()[None, None]
    token = runner.forward(prompt, pos, pos, store, slice(0, batch), causal, "last").logits[:, -1].argmax(-1)
    out = [token]
    mask = torch.ones(CONTEXT + new_tokens, CONTEXT + new_tokens, dtype=torch.bool).tril()[None, None]   # row = position
    t0 = time.perf_counter()
    for step in range(new_tokens - 1):
        at = torch.full((batch, 1), CONTEXT + step)
        logits = runner.forward(token[:, None], at, at, store, slice(0, batch),
                                mask[:, :, CONTEXT + step:CONTEXT + step + 1].expand(batch, 1, 1, -1)).logits
        token = logits[:, -1].argmax(-1)
        out.append(token)
    seconds = time.perf_counter() - t0
    return batch * (new_tokens - 1) / seconds, torch.stack(out, 1).tolist()


@torch.no_grad()
def ops_benchmark(pair: ModelPair, batch_sizes: tuple[int, ...] = (1, 4, 16), new_tokens: int = 32,
                  repeats: int = 3, log=print) -> str:
    target, taps = pair.target, pair.drafter.config.target_layer_ids
    vocab = target.config.vocab_size
    plan = product_plan(target)
    runners = {"reference": TargetRunner(target, taps, plan, fused=False), "fused": TargetRunner(target, taps, plan)}
    rows = []
    for label, batch, parents in (("decode, batch 1", 1, (-1,)), ("verify, batch 8 x tree 8", 8, TREE_PARENTS)):
        counts, logits = {}, {}
        for name, runner in runners.items():
            call, logits[name] = _verify_call(runner, batch, parents, vocab)
            counts[name] = count_ops(call)
        diff = float((logits["fused"] - logits["reference"]).abs().max())
        ref, fus = counts["reference"], counts["fused"]
        log(f"{label}: reference {ref}, fused {fus}, max |logit diff| {diff:.2e}")
        rows.append([label, f"{ref.called}", f"{fus.called}", f"{fus.called / ref.called:.2f}x",
                     f"{ref.total}", f"{fus.total}", f"{fus.total / ref.total:.2f}x", f"{diff:.1e}"])
    ops = markdown_table(["forward", "called: reference", "called: fused", "ratio", "all: reference",
                          "all: fused", "ratio", "max logit diff"], rows)
    speed = []
    for batch in batch_sizes:
        tps: dict[str, list[float]] = {name: [] for name in runners}
        tokens = {}
        decode_goodput(runners["fused"], batch, 4, vocab)   # warm-up
        for _ in range(repeats):
            for name, runner in runners.items():
                rate, tokens[name] = decode_goodput(runner, batch, new_tokens, vocab)
                tps[name].append(rate)
        med = {name: statistics.median(v) for name, v in tps.items()}
        same = sum(a == b for a, b in zip(tokens["reference"], tokens["fused"], strict=True))
        log(f"batch {batch}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in med.items()) + f", {same}/{batch} rows equal")
        speed.append([str(batch), f"{med['reference']:.1f}", f"{med['fused']:.1f}",
                      f"{med['fused'] / med['reference']:.2f}x", f"{same}/{batch}"])
    return (f"Product plan: {runners['fused'].products_described}; {torch.get_num_threads()} threads.\n\n"
            + ops + "\n\n" + markdown_table(["batch", "reference tok/s", "fused tok/s", "fused / reference",
                                             "rows with equal greedy tokens"], speed) + "\n")

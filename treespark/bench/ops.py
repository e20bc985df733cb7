"""How many operators does one target forward launch, reference, fused and compiled, and
what does each do to plain decoding's speed?

Three runners over the same model and product plan, side by side in one run:
``TargetRunner(fused=False)``, the reference (seven products a layer, transformers'
RMSNorm modules, ``rotate_half``); the default fused forward (four products a layer,
``F.rms_norm``, one rope over q and k); and the fused forward with its norms, rotation
and activation compiled by ``torch.compile`` (``compile_backend="inductor"``). Operators are counted
with ``torch.profiler`` over one forward after a warm-up: *called* = the operators the
forward's Python calls (``aten::``, ``mkldnn::``, ..., and each call into a compiled
region; an operator called from inside another is not counted again), *all* = every
operator event, those nested in composites included (on CPU ``F.rms_norm`` is such a
composite: one call, several kernels). Two shapes: decoding at batch 1 (1 token after a
64-token context), and a verify forward at batch 8 x an 8-node tree. Goodput is plain
greedy decoding through the runner alone (no drafter, no engine): rows x new tokens /
seconds after a batched prefill, the median of ``repeats`` runs, the runners
interleaved. With a pair name, a third table: the compiled forward's first calls in a
fresh process and in a cached one (``treespark.bench.compile_time``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from treespark.bench.common import markdown_table
from treespark.bench.forward_calls import TREE_PARENTS, decode_goodput, verify_call
from treespark.engine.products import product_plan
from treespark.engine.target import TargetRunner
from treespark.models.pair import ModelPair

COMPILED_REGION = "Torch-Compiled Region"   # the profiler's name for a call into torch.compile's code


@dataclass(frozen=True)
class OpCount:
    called: int   # operators called by the profiled code itself
    total: int    # every operator event, nested ones included


def _is_op(e) -> bool:
    """An operator, or a region torch.compile made (one call; it runs compiled kernels)."""
    return "::" in e.name or e.name.startswith(COMPILED_REGION)


def top_level_ops(events) -> list:
    """The operators (``_is_op``) the profiled code calls itself, not from inside another."""
    def nested(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if _is_op(p):
                return True
            p = p.cpu_parent
        return False

    return [e for e in events if _is_op(e) and not nested(e)]


def count_ops(fn: Callable[[], object]) -> OpCount:
    """The operators ``fn()`` launches on this thread, counted by ``torch.profiler``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    return OpCount(len(top_level_ops(events)), sum(_is_op(e) for e in events))


RUNNERS = ("reference", "fused", "compiled")


@torch.no_grad()
def ops_benchmark(pair: ModelPair, batch_sizes: tuple[int, ...] = (1, 4, 16), new_tokens: int = 32,
                  repeats: int = 3, log=print, pair_name: str | None = None) -> str:
    """The three tables of the module's docstring; ``pair_name`` (``pair_by_name``'s):
    also time the compiled forward's first calls in fresh processes (``compile_time``)."""
    target, taps = pair.target, pair.drafter.config.target_layer_ids
    vocab = target.config.vocab_size
    plan = product_plan(target)
    runners = {"reference": TargetRunner(target, taps, plan, fused=False), "fused": TargetRunner(target, taps, plan),
               "compiled": TargetRunner(target, taps, plan, compile_backend="inductor")}
    rows = []
    for label, batch, parents in (("decode, batch 1", 1, (-1,)), ("verify, batch 8 x tree 8", 8, TREE_PARENTS)):
        counts, logits = {}, {}
        for name, runner in runners.items():
            call, logits[name] = verify_call(runner, batch, parents, vocab)   # compiles, for "compiled"
            counts[name] = count_ops(call)
        diff = max(float((logits[n] - logits["reference"]).abs().max()) for n in ("fused", "compiled"))
        ref = counts["reference"]
        log(f"{label}: " + ", ".join(f"{n} {c}" for n, c in counts.items()) + f", max |logit diff| {diff:.2e}")
        rows.append([label] + [f"{counts[n].called}" + ("" if n == "reference" else f" ({counts[n].called / ref.called:.2f}x)")
                               for n in RUNNERS]
                    + [f"{counts[n].total}" for n in RUNNERS] + [f"{diff:.1e}"])
    ops = markdown_table(["forward"] + [f"called: {n}" for n in RUNNERS] + [f"all: {n}" for n in RUNNERS]
                         + ["max logit diff"], rows)
    speed = []
    for batch in batch_sizes:
        tps: dict[str, list[float]] = {name: [] for name in runners}
        tokens = {}
        for runner in runners.values():
            decode_goodput(runner, batch, 4, vocab)   # warm-up (and the compiled runner's shapes)
        for _ in range(repeats):
            for name, runner in runners.items():
                rate, tokens[name] = decode_goodput(runner, batch, new_tokens, vocab)
                tps[name].append(rate)
        med = {name: statistics.median(v) for name, v in tps.items()}
        same = [sum(a == b for a, b in zip(tokens["reference"], tokens[n], strict=True)) for n in ("fused", "compiled")]
        log(f"batch {batch}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in med.items()) + f", equal rows {same}")
        speed.append([str(batch)] + [f"{med[n]:.1f}" for n in RUNNERS]
                     + [f"{med['fused'] / med['reference']:.2f}x", f"{med['compiled'] / med['reference']:.2f}x",
                        f"{same[0]}/{batch}, {same[1]}/{batch}"])
    text = (f"Product plan: {runners['fused'].products_described}; {torch.get_num_threads()} threads.\n\n"
            + ops + "\n\n" + markdown_table(["batch"] + [f"{n} tok/s" for n in RUNNERS]
                                             + ["fused / reference", "compiled / reference",
                                                "rows with reference's greedy tokens (fused, compiled)"], speed) + "\n")
    if pair_name is not None:
        from treespark.bench.compile_time import STARTS, compile_times

        times = compile_times(pair_name)
        log(f"compile times: {times}")
        text += "\n" + markdown_table(
            ["start", "first decode forward (s)", "first verify forward, batch 8 x tree 8 (s)",
             "a compiled decode forward (s)"],
            [[s, f"{times[s]['decode_s']:.1f}", f"{times[s]['verify_s']:.1f}", f"{times[s]['compiled_decode_s']:.3f}"]
             for s in STARTS]) + "\n"
    return text

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
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from treespark.bench.common import markdown_table
from treespark.bench.device_correctness import (
    Checks,
    Inject,
    check_greedy,
    check_loader,
    check_logits,
    preflight,
)
from treespark.bench.device_pair import POLICIES, SERVED, CheckConfig, build_pair
from treespark.bench.device_timing import bandwidth, served_allocator, timed_decode
from treespark.models.pair import pick_device
from treespark.spec.budget import Budget


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

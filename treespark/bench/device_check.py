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
import traceback
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
    check_keyed_noise,
    check_loader,
    check_logits,
    preflight,
)
from treespark.bench.device_launches import step_launches
from treespark.bench.device_pair import POLICIES, SERVED, CheckConfig, build_pair
from treespark.bench.device_timing import bandwidth, served_allocator, timed_decode
from treespark.models.pair import pick_device
from treespark.spec.budget import Budget


# -- the run -------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def device_check(config: CheckConfig, out_dir: str | Path, *, device: str | None = None,
                 log: Callable[[str], None] = print, inject: Inject | None = None,
                 dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Run the check; writes ``device-check.md`` and ``device-check.json`` to ``out_dir``
    (after every section, so a run cut short leaves what it measured) and returns the
    JSON dict. ``ok``: every correctness check passed and no section raised; a section
    that raises is recorded under ``errors`` and the rest still run. ``inject``: a test
    hook that may alter named tensors (``runner_logits``, ``drafter_logits``). ``dtype``:
    the weights' (default bfloat16 on CUDA, float32 elsewhere)."""
    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = pick_device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    pair = build_pair(config.shape, dev, dtype, config.seed)
    log(f"{config.shape.name} pair built on {dev} ({dtype}) in {time.perf_counter() - t_start:.1f} s")
    checks = Checks()
    result: dict[str, Any] = {"config": asdict(config), "preflight": preflight(pair, dev), "checks": checks.rows,
                              "errors": {}}
    log(f"preflight: {result['preflight']}")

    def section(name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # recorded, reported and failed; the other sections still run
            result["errors"][name] = traceback.format_exc()[-4000:]
            log(f"ERROR in {name}:\n{result['errors'][name]}")
        result["ok"] = checks.ok and not result["errors"]
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        (out / "device-check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / "device-check.md").write_text(render(result))
        log(f"{name}: {time.perf_counter() - t:.1f} s")
        return result.get(name)

    def launches() -> dict[str, Any]:
        rows = result["launches"] = {}
        for forward in config.forwards:
            rows |= step_launches(pair, dev, config.seed, forward=forward)
        return rows

    section("launches", launches)
    log(f"launches: {result.get('launches')}")
    section("logits", lambda: [check_logits(pair, dev, checks, inject, config.seed, f) for f in config.forwards])

    def greedy() -> dict[str, Any]:
        report = result["greedy"] = {}
        for forward in config.forwards:
            report |= check_greedy(pair, dev, config, checks, forward)
        return report

    section("greedy", greedy)
    section("loader", lambda: check_loader(pair, dev, config, checks))
    section("keyed noise", lambda: check_keyed_noise(dev, pair.vocab_size, checks, config.seed))
    for r in checks.rows:
        log(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']}: {r['value']} ({r['bound']})")

    def throughput() -> list[dict[str, Any]]:
        t1 = time.perf_counter()
        allocator = served_allocator(pair, config, dev)
        log(f"served policy's step costs measured in {time.perf_counter() - t1:.1f} s")
        policies: dict[str, Budget] = {**POLICIES, SERVED: Budget.adaptive()}
        rows = result["throughput"] = []  # filled as it goes: a failure keeps the rows before it
        for forward in config.forwards:
            mode = forward.name
            for t in config.temperatures:
                for bs in config.batch_sizes:
                    for name, budget in policies.items():
                        r = timed_decode(pair, budget, bs, t, config, dev, allocator if name == SERVED else None,
                                         forward=forward)
                        rows.append({"forward": mode, "T": t, "batch": bs, "policy": name, **r})
                        log(f"{mode} T={t:g} batch={bs} {name}: {r['tokens_per_s']:.1f} tok/s, "
                            f"step {_ms(r['step'])} ms")
        return rows

    section("throughput", throughput)

    def long_context() -> list[dict[str, Any]]:
        rows = result["long_context"] = []
        for bs, ctx in config.long_context:
            r = timed_decode(pair, POLICIES["tree of 32"], bs, 0.0,
                             replace(config, timed_steps=min(config.timed_steps, 4)), dev, prompt_len=ctx)
            rows.append({"batch": bs, "context": ctx, "verify_s": r["verify"], "step_s": r["step"],
                         "peak_gib": r["peak_gib"]})
            log(f"long context batch={bs} ctx={ctx}: verify {_ms(r['verify'])} ms")
        return rows

    section("long_context", long_context)

    def floor() -> dict[str, Any]:
        weight_bytes = sum(p.numel() * p.element_size() for p in pair.target.parameters())
        bw = bandwidth(dev, config.bandwidth_bytes)
        plain1 = {r["forward"]: r["step"] for r in result.get("throughput") or []
                  if r["policy"] == "plain" and r["batch"] == min(config.batch_sizes) and r["T"] == 0}
        return {"weight_bytes": weight_bytes, "bandwidth_gb_s": bw / 1e9, "floor_s": weight_bytes / bw,
                "plain_step_s": plain1}  # by forward: eager, inductor, graphs

    section("floor", floor)
    return result


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a markdown table cell


def render(r: dict[str, Any]) -> str:
    """The markdown report of what ``r`` holds so far (a section not yet run is absent)."""
    cfg, pre = r["config"], r["preflight"]
    lines = [f"# Device check: {cfg['shape']['name']} shapes, random weights, on {pre['device_name']} "
             f"({pre['dtype']})", "",
             f"`treespark device-check`: {'PASSED' if r.get('ok') else 'FAILED'} in {r.get('seconds', 0):.0f} s.",
             "", "## Preflight", ""]
    lines += [f"- {k}: {v}" for k, v in pre.items()]
    if r.get("launches"):
        lines += ["", "## Launches per step", "",
                  "One engine step at batch 1, T = 0, under `torch.profiler`: on CUDA the kernels the host "
                  "launched (in the step, inside the target forward and inside the drafter's block pass) and "
                  "the attention kernels by name; on CPU the operators called.", "",
                  markdown_table(["policy", "counted", "per step", "per target forward", "per drafter pass",
                                  "attention kernels"],
                                 [[name + (f" ({x['captures']} captured in the step)" if x.get("captures") else ""),
                                   x["unit"], str(x["per_step"]), f"{x['per_forward']:.0f}",
                                   f"{x['per_draft']:.0f}" if x.get("drafts") else "-",
                                   _cell(", ".join(x["attention_kernels"]) or "none seen")]
                                  for name, x in r["launches"].items()])]
    lines += ["", "## Correctness", "", markdown_table(
        ["check", "result", "value", "bound"],
        [[_cell(c["check"]), "ok" if c["ok"] else "**FAIL**", _cell(c["value"]), _cell(c["bound"])]
         for c in r["checks"]])]
    if r.get("throughput"):
        lines += ["", "## Throughput", "",
                  f"{cfg['timed_steps']} timed steps per row, every one at the full batch, after "
                  f"{cfg['prompt_len']}-token prompts; medians per step in ms. verify: the target forward; "
                  "backbone: the drafter's block pass; draft: the whole drafting stage (backbone and depth waves); "
                  "walk: verification after the forward (acceptance, commit); rest: the step less verify and "
                  "backbone (host Python and the small device calls); syncs: synchronisations seen by "
                  "`torch.cuda.set_sync_debug_mode` (CUDA only); copies: the engine's own count of "
                  "device-to-host copies and waits.", "",
                  markdown_table(["forward", "T", "batch", "policy", "tokens/s", "step", "verify", "backbone", "draft", "walk",
                                  "rest", "syncs", "copies", "nodes/row"],
                                 [[t.get("forward", "eager"), f"{t['T']:g}", str(t["batch"]), t["policy"], f"{t['tokens_per_s']:.1f}",
                                   _ms(t["step"]), _ms(t["verify"]), _ms(t["backbone"]), _ms(t["draft"]),
                                   _ms(t["walk"]), _ms(t["rest"]), "-" if t["syncs"] is None else str(t["syncs"]),
                                   str(t["copies"]), f"{t['nodes']:.1f}"] for t in r["throughput"]])]
    if r.get("long_context"):
        lines += ["", "## Long context", "", "A tree of 32 at T = 0 after long prompts.", "",
                  markdown_table(["batch", "context", "verify ms", "step ms", "peak GiB"],
                                 [[str(x["batch"]), str(x["context"]), _ms(x["verify_s"]), _ms(x["step_s"]),
                                   "-" if x["peak_gib"] is None else f"{x['peak_gib']:.1f}"]
                                  for x in r["long_context"]])]
    if r.get("floor"):
        f = r["floor"]
        lines += ["", "## The floor", "",
                  f"Target weights {f['weight_bytes'] / 2**30:.2f} GiB over a measured copy bandwidth of "
                  f"{f['bandwidth_gb_s']:.1f} GB/s: a decode step cannot take less than {_ms(f['floor_s'])} ms. "
                  f"Plain decoding's step at batch {min(cfg['batch_sizes'])}: "
                  + ", ".join(f"{_ms(s)} ms ({fw})" for fw, s in f["plain_step_s"].items()) + "."]
    for name, tb in r.get("errors", {}).items():
        lines += ["", f"## Error in {name}", "", "```", tb.rstrip(), "```"]
    return "\n".join(lines) + "\n"

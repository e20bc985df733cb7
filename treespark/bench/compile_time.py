"""How long ``torch.compile`` takes the target forward's layer ops
(``TargetRunner(compile_backend="inductor")``): on a fresh start, with an empty inductor cache, and on
a cached start, a new process over the same cache. Each start is its own process
(``python -m treespark.bench.compile_time PAIR``), timing the first decode forward at
batch 1 and the first verify forward at batch 8 x an 8-node tree (each compiles the
graphs its shapes need), then one more decode forward (compiled already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

STARTS = ("fresh", "cached")


@torch.no_grad()
def first_calls(pair_name: str) -> dict[str, float]:
    """Seconds of the first forwards of a compiled runner over ``pair_name``'s target."""
    from treespark.bench.forward_calls import TREE_PARENTS, verify_call
    from treespark.engine.products import product_plan
    from treespark.engine.target import TargetRunner
    from treespark.models.pair import pair_by_name

    pair = pair_by_name(pair_name, progress=False)
    target, taps = pair.target, pair.drafter.config.target_layer_ids
    runner = TargetRunner(target, taps, product_plan(target), compile_backend="inductor")
    out = {}
    for label, batch, parents in (("decode_s", 1, (-1,)), ("verify_s", 8, TREE_PARENTS)):
        t0 = time.perf_counter()
        call, _ = verify_call(runner, batch, parents, target.config.vocab_size)  # a prefill, then the call
        out[label] = time.perf_counter() - t0
        if label == "decode_s":
            t0 = time.perf_counter()
            call()
            out["compiled_decode_s"] = time.perf_counter() - t0
    return out


def compile_times(pair_name: str) -> dict[str, dict[str, float]]:
    """``first_calls`` in a fresh process with an empty inductor cache, then in another
    over the same cache."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # where inductor caches, not what it does
        for start in STARTS:
            proc = subprocess.run([sys.executable, "-m", "treespark.bench.compile_time", pair_name], env=env,
                                  capture_output=True, text=True, check=True)
            out[start] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


if __name__ == "__main__":
    print(json.dumps(first_calls(sys.argv[1])))

"""Which matrix-product layout is fastest for decoding's few-row forwards?

One pass multiplies every product weight of the target's forward (30 layers x 4 with
q|k|v and gate|up stacked, plus the LM head) by ``rows`` rows, as a forward does, in
each layout, side by side in one run (median of ``reps`` passes):

- ``F.linear``: ``x @ W^T``;
- ``W @ X``, X column-major: what chaining ``(W @ x^T).T`` into the next product hands it;
- ``W @ x^T``, x row-major;
- ``treespark.kernels.linear``: ``W @ x^T`` row-major with its padding (1 -> 2 rows, 10-15 -> 16)
  up to ``SMALL_ROWS`` rows, ``F.linear`` above;
- oneDNN packed: ``packed_linear`` on weights packed once (where ``can_pack``);
- ``W x`` (one row): ``matvec_linear``, a matrix-vector product (gemv) at one row;
- ``treespark.kernels.native``: ``native_linear``, ``gemv.c`` built for this CPU, up to
  ``MAX_ROWS`` rows (where a C compiler built it);
- ``treespark.kernels.native bf16``: the same kernel on bfloat16 copies of the weights
  (half the bytes), what a target of bfloat16 values runs (``treespark.models.precision``).

Beside them, a ``sum`` over each weight: the same bytes read once, what a pass would
take at the machine's read bandwidth.

This is how ``treespark.kernels.linear``'s rules and constants were chosen. ``TargetRunner``
does not use fixed rules: it runs each row count in the fastest of ``F.linear``,
``treespark.kernels.linear``, oneDNN packed, ``W x`` and native, timed when it starts (``product_plan``); the
table ends with the plan these passes choose.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from treespark.bench.common import markdown_table
from treespark.engine.products import halvable, model_products, packable
from treespark.kernels.linear import (
    F_LINEAR,
    HALF,
    MATVEC,
    NATIVE,
    PACKED,
    SMALL,
    choose_plan,
    linear,
    matvec_linear,
    packed_linear,
    timed_rows,
)
from treespark.kernels.linear import LAYOUTS as PLAN_LAYOUTS
from treespark.kernels.native import can_panel, can_run, native_linear, to_panels
from treespark.models.pair import ModelPair

LAYOUTS = {
    F_LINEAR: lambda x, w: F.linear(x, w),
    "W @ X (col-major)": lambda x, w: w @ x.T.contiguous(),
    "W @ x^T (row-major)": lambda x, w: (w @ x.T).T.contiguous(),
    SMALL: linear,
}
READ = "sum (the weights read once)"


def _pass_ms(ws: list[torch.Tensor], n: int, fn, reps: int) -> float:
    xs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=w.dtype, device=w.device) for w in ws}

    def one_pass() -> None:
        for w in ws:
            fn(xs[w.shape[1]], w)

    one_pass()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.no_grad()
def linear_benchmark(pair: ModelPair, rows=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128), reps: int = 5,
                     log=print) -> str:
    can, half = packable(pair.target), halvable(pair.target)
    products = model_products(pair.target, packed=can).products()  # the copies TargetRunner multiplies by
    ws = [p.weight for p in products]
    layouts = dict(LAYOUTS)
    if can:
        by_weight = {id(p.weight): p.packed for p in products}
        layouts[PACKED] = lambda x, w: packed_linear(x, by_weight[id(w)])
    layouts[MATVEC] = matvec_linear
    if all(w.dtype == torch.float32 and can_run(w) for w in ws):
        layouts[NATIVE] = native_linear
        # the bfloat16 panels a bfloat16-valued target reads (timed on these weights rounded:
        # the same bytes and work, whatever the values)
        if all(can_panel(w) for w in ws):
            halves = {id(w): to_panels(w) for w in ws}
            layouts[HALF] = lambda x, w: native_linear(x, halves[id(w)])
    most = timed_rows(list(halves.values()) if HALF in layouts else None)
    layouts[READ] = lambda x, w: w.sum()
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    out, candidates = [], {}
    for n in rows:
        ms = {name: _pass_ms(ws, n, fn, reps) for name, fn in layouts.items() if n <= most.get(name, n)}
        log(f"rows={n:>3} " + "  ".join(f"{k} {v:6.1f} ms" for k, v in ms.items()))
        best = min(v for k, v in ms.items() if k != READ)
        out.append([str(n)] + [f"{ms[k]:.1f}" + (" *" if ms[k] == best else "") if k in ms else "-"
                               for k in layouts] + [f"{nbytes / best / 1e6:.1f} ({ms[READ] / best:.2f})"])
        candidates[n] = {k: ms[k] for k in PLAN_LAYOUTS if k in ms and (k != HALF or half)}
    plan = choose_plan(candidates)
    return (markdown_table(["rows"] + [f"{k} (ms per pass)" for k in layouts]
                           + ["fastest: GB/s of weights (share of the sum's)"], out)
            + f"\n\nA pass reads {nbytes / 1e6:.0f} MB of {ws[0].dtype} weights ({HALF}: half of it). "
            f"The plan these passes "
            f"choose (of {', '.join(candidates[rows[0]])}): {plan.describe()}.\n")

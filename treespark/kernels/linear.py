"""Matrix products for the few-row forwards of decoding, on CPU.

A decoding step multiplies each weight by a handful of rows, and the weights
stream from memory once per step. On the CPU BLAS that torch ships, the layout of
such a product decides its speed (`treespark bench linear` times a pass over the
target's weights in each layout, side by side):

- ``W @ x^T`` with ``x`` row-major (``x^T`` a transposed view) is the fast one;
- ``F.linear`` (``x @ W^T``) is 2-3x slower at 2-8 rows;
- ``W @ X`` with ``X`` column-major is as slow, and that is what the *output* of
  ``(W @ x^T).T`` hands the next product unless it is made row-major again;
- one row runs as a matrix-vector product on a single thread, so it is padded to
  two rows, which run on every thread;
- 10-15 rows run slower than 16 (the AVX-512 width), so they are padded to 16.

``linear`` applies these rules to CPU products of up to ``SMALL_ROWS`` rows and
calls ``F.linear`` otherwise (more rows, where it is faster, or an accelerator).
The constants were measured on a two-core AVX-512 machine; the benchmark
re-measures them anywhere.

From three rows on, faster still, and nearly flat in the row count, is oneDNN's
matrix product on a weight reordered once into its blocked layout (``pack`` /
``packed_linear``; the op PyTorch's own CPU compiler emits for frozen linears).
It keeps a second copy of each packed weight, so the target's forward packs its
weights and the drafter (trained as well as served) uses ``linear``.

At one row, ``matvec_linear`` multiplies as a matrix-vector product (``torch.mv``, the
BLAS gemv) without ``linear``'s padding: on a two-core AMD EPYC (Zen 3, AVX2) it read the
weights faster than ``F.linear`` (75 against 92 ms a pass over the default target's, two
loaded runs), where on the AVX-512 machine a single-threaded gemv was the slow path.

``native_linear`` (``treespark.kernels.native``, up to 16 rows) streams each weight once and
multiplies it by every row while it sits in L1; ``HALF`` is the same kernel reading a
bfloat16 copy of a weight whose values are bfloat16 values (``treespark.models.precision``):
half the bytes, the same values.

Which of these (``F.linear``, ``linear``, packed, ``W x`` at one row, native, half) is fastest at a row count is a
property of the machine, not of the code: on a two-core AVX-512 machine ``linear``
beat ``F.linear`` 1.5x at 1-4 rows, on a two-core AVX-512 + AMX Xeon ``F.linear`` beat
it 2.6x. So the target's forward does not fix the choice: ``measure_plan`` times one
pass over the weights in each layout at a few row counts, and ``choose_plan`` keeps
the fastest per row count (a native layout unless it is clearly slower: it also runs the
whole layer stack natively) as a ``ProductPlan`` (measured once per model and process,
``treespark.engine.products.product_plan``, which keeps it on disk per machine). Every layout
gives ``F.linear``'s values to float rounding; a plan fixes which rounding a forward of
n rows gets.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treespark.kernels.native import MAX_ROWS as NATIVE_ROWS
from treespark.kernels.native import can_run, exact_panels, most_rows, native_linear

SMALL_ROWS = 64  # at or below this many rows, CPU products run as W @ x^T


def padded_rows(n: int) -> int:
    """How many rows a CPU product of ``n`` rows runs with (``n`` <= ``SMALL_ROWS``)."""
    if n == 1:
        return 2
    if 10 <= n < 16:
        return 16
    return n


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape [..., in]; the result is row-major."""
    n = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if x.device.type != "cpu" or n == 0 or n > SMALL_ROWS:
        return F.linear(x, weight, bias)
    rows = x.reshape(n, x.shape[-1])
    m = padded_rows(n)
    if m > n:
        rows = torch.cat([rows, rows[:1].expand(m - n, -1)])
    y = (weight @ rows.contiguous().T).T[:n].contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class PackedWeight:
    """A float32 CPU weight [out, in] in oneDNN's blocked layout (a copy), with its bias."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``pack`` applies: a float32 CPU matrix and a PyTorch built with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """Reorder a copy of ``weight`` for ``packed_linear``; ValueError where ``can_pack`` is False."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} on "
                         f"{weight.device.type} (oneDNN available: {torch.backends.mkldnn.is_available()})")
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return PackedWeight(packed, None if bias is None else bias.detach(), weight.shape[0])


def packed_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """``F.linear`` with a packed weight, for ``x`` of shape [..., in] (no gradients)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, w.packed, w.bias, "none", [], "")
    return y.view(*x.shape[:-1], w.out_features)


def matvec_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, one row as a matrix-vector product ``W x`` (``torch.mv``, BLAS's gemv);
    more rows as ``F.linear``."""
    n = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if n != 1:
        return F.linear(x, weight, bias)
    y = torch.mv(weight, x.reshape(-1))
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def on_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``unplanned_linear`` runs ``x`` by ``weight`` on ``native_linear``: float32
    CPU rows, 1 to its ``MAX_ROWS`` of them, a float32 weight it takes, no gradients."""
    n = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not grads
            and 1 <= n <= NATIVE_ROWS and can_run(weight))


def unplanned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     half: torch.Tensor | None = None) -> torch.Tensor:
    """A product outside the target's plan (the drafter's, its Markov head's): where
    ``on_native``, ``native_linear`` (2-3x ``linear`` at every drafter shape on a two-core
    Zen 3: 0.60 against 1.93 ms for the shared head [8192, 576] at 6 rows), on ``half``
    if given (a bfloat16 copy holding ``weight``'s values: half the bytes, the same
    products); ``linear`` otherwise (training, more rows, an accelerator)."""
    if on_native(x, weight):
        return native_linear(x, weight if half is None else half, bias)
    return linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose products go through
    ``unplanned_linear``: on the native kernel, on the weight's exact bfloat16 panels where
    they hold it (``exact_panels``: a drafter stored in bfloat16), found once per weight
    version and kept beside it (not in the state dict)."""

    _panels: tuple | None = None   # (the weight's storage, version, dtype and device; its panels or None)

    def panels(self) -> torch.Tensor | None:
        """The weight's exact bfloat16 panels, or None where they would not hold it."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._panels is None or self._panels[0] != key:
            self._panels = key, exact_panels(w.detach())
        return self._panels[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not on_native(x, self.weight):
            return linear(x, self.weight, self.bias)
        half = self.panels()
        return native_linear(x, self.weight if half is None else half, self.bias)


F_LINEAR, SMALL, PACKED = "F.linear", "treespark.kernels.linear", "oneDNN packed"
MATVEC = "W x (one row)"
NATIVE = "treespark.kernels.native"
HALF = "treespark.kernels.native bf16"   # native, on the weight's bfloat16 copy (exact values)
LAYOUTS = (F_LINEAR, SMALL, PACKED, MATVEC, NATIVE, HALF)
MOST_ROWS = {MATVEC: 1, NATIVE: NATIVE_ROWS, HALF: NATIVE_ROWS}  # the most rows a layout is timed at (absent: any)
PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # the row counts ``measure_plan`` times
PLAN_SAMPLE_BYTES = 512 << 20  # ``measure_plan`` times whole layers up to this many weight bytes


def timed_rows(halves: Sequence[torch.Tensor] | None) -> dict[str, int]:
    """``MOST_ROWS``, without ``HALF``'s limit where every bfloat16 copy in ``halves`` takes
    any rows (``native.most_rows``: AMX tiles)."""
    free = bool(halves) and all(most_rows(h) is None for h in halves)
    return {k: v for k, v in MOST_ROWS.items() if k != HALF or not free}


@dataclass(frozen=True)
class ProductPlan:
    """The layout a CPU product of ``n`` rows runs in: ``layouts[i]`` for ``n`` up to
    ``rows[i]`` (and above ``rows[i - 1]``); the last one for every ``n`` beyond."""

    rows: tuple[int, ...]
    layouts: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.layouts):
            raise ValueError(f"a ProductPlan needs one layout per row count, got {self.rows} and {self.layouts}")
        if list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"ProductPlan.rows must be increasing and >= 1, got {self.rows}")
        unknown = set(self.layouts) - set(LAYOUTS)
        if unknown:
            raise ValueError(f"unknown product layouts {sorted(unknown)}; known: {LAYOUTS}")

    @classmethod
    def fixed(cls, layout: str) -> ProductPlan:
        """One layout at every row count."""
        return cls((1,), (layout,))

    def layout(self, n: int) -> str:
        return self.layouts[min(bisect_left(self.rows, n), len(self.rows) - 1)]

    def describe(self) -> str:
        """E.g. ``rows 1-4 F.linear, 5-32 oneDNN packed, 33+ F.linear``; ``all rows F.linear``."""
        parts, lo = [], 1
        for i, (hi, name) in enumerate(zip(self.rows, self.layouts, strict=True)):
            last = i == len(self.rows) - 1
            if not last and self.layouts[i + 1] == name:
                continue
            parts.append(f"{lo}+ {name}" if last else f"{lo}-{hi} {name}" if hi > lo else f"{lo} {name}")
            lo = hi + 1
        return ("rows " + ", ".join(parts)).replace("rows 1+ ", "all rows ")


def planned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: ProductPlan | None,
                   packed: PackedWeight | None = None, half: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [N, in], in ``plan``'s layout for N rows
    (``F.linear`` where ``plan`` is None); ``packed``: ``weight`` packed, ``half``: its
    bfloat16 copy (exact), for those layouts."""
    layout = F_LINEAR if plan is None else plan.layout(x.shape[0])
    if layout == PACKED:
        if packed is None:
            raise ValueError(f"the product plan runs {x.shape[0]} rows packed, and this weight has no packed copy")
        return packed_linear(x, packed)
    if layout == HALF:
        if half is None:
            raise ValueError(f"the product plan runs {x.shape[0]} rows on bfloat16 copies, and this weight has none")
        if x.shape[0] > (most_rows(half) or x.shape[0]):   # past the kernel's rows (a plan fixed to it):
            return F.linear(x, weight, bias)               # the same values in float32
        return native_linear(x, half, bias)
    if layout == SMALL:
        return linear(x, weight, bias)
    if layout == MATVEC:
        return matvec_linear(x, weight, bias)
    if layout == NATIVE:
        return native_linear(x, weight, bias)
    return F.linear(x, weight, bias)


PLAN_MARGIN = 0.05  # another layout replaces F.linear only where it is this much faster
# a native layout is kept where it is at most this much slower than the fastest product:
# it also runs the target's whole layer stack as one native call (``treespark.kernels.blocks``),
# where any other layout runs each layer on torch operators. The default target in float32,
# one process, two threads: 3-row forwards 41.0 ms on F.linear and torch operators against
# 18.8 ms natively, 8 rows 42.4 ms on oneDNN against 28.1, for products 1-6 % apart
NATIVE_MARGIN = 0.25


def choose_plan(ms: Mapping[int, Mapping[str, float]], margin: float = PLAN_MARGIN,
                native_margin: float = NATIVE_MARGIN) -> ProductPlan:
    """The layout of each timed row count (``ms[rows][layout]``: ms per pass): a native
    one (``HALF`` or ``NATIVE``) where it is within ``native_margin`` of the fastest
    (the fused stack it brings saves more than the products lose), else the fastest
    where it beats ``F.linear`` by more than ``margin`` (a fraction of F.linear's time),
    else ``F.linear``. Near-ties, which timing noise would decide, so fall the same way
    in every process. Native float32 replaces native bfloat16 (the same values from
    half the bytes) only by ``margin``: a plan timed on a busy machine once ran 3 rows
    on float32 between 2 and 4 on bfloat16, every 3-token verify at twice the bytes."""
    layouts = []
    for n in sorted(ms):
        t = ms[n]
        best = min(t, key=t.__getitem__)
        native = HALF if HALF in t and (NATIVE not in t or t[NATIVE] >= (1 - margin) * t[HALF]) else \
            NATIVE if NATIVE in t else None
        if native is not None and t[native] <= (1 + native_margin) * t[best]:
            layouts.append(native)
            continue
        keep = F_LINEAR in t and t[best] >= (1 - margin) * t[F_LINEAR]
        layouts.append(F_LINEAR if keep else best)
    return ProductPlan(tuple(sorted(ms)), tuple(layouts))


def plan_sample(weights: Sequence[torch.Tensor], per_layer: int, budget: int = PLAN_SAMPLE_BYTES) -> list[int]:
    """Indices of the weights ``measure_plan`` times: whole layers (``per_layer`` weights
    each, in order) up to ``budget`` bytes, and the last weight (an LM head) when it is
    not a layer's. More bytes than the caches hold, so that a pass streams from memory
    as a forward's does."""
    n_layers = len(weights) // per_layer if per_layer else 0
    chosen, total = [], 0
    for layer in range(n_layers):
        idx = range(layer * per_layer, (layer + 1) * per_layer)
        chosen.extend(idx)
        total += sum(weights[i].numel() * weights[i].element_size() for i in idx)
        if total >= budget:
            break
    if len(weights) > n_layers * per_layer:
        chosen.append(len(weights) - 1)
    return chosen


def measure_plan(weights: Sequence[torch.Tensor], packed: Sequence[PackedWeight] | None = None,
                 rows: Sequence[int] = PLAN_ROWS, reps: int = 3,
                 halves: Sequence[torch.Tensor] | None = None) -> tuple[ProductPlan, dict[int, dict[str, float]]]:
    """Times one pass over ``weights`` (CPU, [out, in]) at each row count in each layout
    (``packed``: the same weights packed, else no packed layout; ``halves``: their exact
    bfloat16 copies, else no half layout), interleaved so that a
    drift in the machine's speed falls on every layout alike; the fastest of ``reps``
    passes after one untimed one (another process's work only ever adds time, so the
    fastest pass is the nearest a busy machine gets to the product's own cost). Returns
    the plan and the times (ms per pass)."""
    if reps < 1:
        raise ValueError("measure_plan needs reps >= 1")
    for name, extra in (("packed", packed), ("half", halves)):
        if extra is not None and len(extra) != len(weights):
            raise ValueError(f"{len(extra)} {name} weights for {len(weights)} weights")
    gen = torch.Generator().manual_seed(0)
    dims = {w.shape[1] for w in weights}
    xs = {n: {d: torch.randn(n, d, generator=gen, dtype=weights[0].dtype) for d in dims} for n in rows}
    fns: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        F_LINEAR: lambda x, i: F.linear(x, weights[i]),
        SMALL: lambda x, i: linear(x, weights[i]),
        MATVEC: lambda x, i: matvec_linear(x, weights[i]),  # timed at one row only: F.linear beyond
    }
    if packed is not None:
        fns[PACKED] = lambda x, i: packed_linear(x, packed[i])
    if all(w.dtype == torch.float32 and can_run(w) for w in weights):   # (a bfloat16 weight: panels only)
        fns[NATIVE] = lambda x, i: native_linear(x, weights[i])
        if halves is not None and all(can_run(h) for h in halves):
            fns[HALF] = lambda x, i: native_linear(x, halves[i])
    most = timed_rows(halves)
    times: dict[int, dict[str, list[float]]] = {n: {name: [] for name in fns if n <= most.get(name, n)}
                                                 for n in rows}
    with torch.no_grad():
        for rep in range(reps + 1):
            for n in rows:
                for name in times[n]:
                    fn = fns[name]
                    t0 = time.perf_counter()
                    for i, w in enumerate(weights):
                        fn(xs[n][w.shape[1]], i)
                    if rep:
                        times[n][name].append((time.perf_counter() - t0) * 1e3)
    ms = {n: {name: min(t) for name, t in by.items()} for n, by in times.items()}
    return choose_plan(ms), ms

"""A few-row matrix product built for the CPU it runs on (``gemv.c``), for the product plan.

At one to a few rows a decoding step's products are bound by reading the weights, and on
a two-core AMD EPYC (Zen 3, AVX2) the fastest library layout (oneDNN's packed weights)
read them at ~0.6 of what a ``sum`` over the same bytes reads (`treespark bench linear`).
``gemv.c`` streams each weight once and multiplies it by every row while it sits in L1,
split over torch's own OpenMP threads. A bfloat16 weight (the half copy of a float32
weight whose values are bfloat16 values, ``treespark.models.precision``) is read at half
the bytes, in panels of 16 rows (``to_panels``), and widened exactly: the same values as
its float32 original, and a few rows cost little more than one (``gemv.c``).

The C files (``gemv.c``; ``blocks.c``: a decoder layer's few-row forward around its
attention, and its norms, rotation and activation over any rows, ``treespark.kernels.blocks``; ``waves.c``: a greedy round's draft trees,
``treespark.spec.native_forest``; ``chunks.c``: a prefill's chunks' attention,
``treespark.kernels.chunks``; ``best.c``: the per-step allocation's argmax,
``treespark.kernels.best``; ``vocab.c``: each row's argmax over the vocabulary,
``treespark.kernels.vocab``) are compiled once per machine, source and
compiler (``cc -O3 -march=native -fopenmp``; a second or so) into
``~/.cache/treespark/kernels/`` under a ``filelock``, and loaded with ``ctypes``, which
releases the GIL during the call. Where there is no C compiler or the build fails, ``library()`` is None, the product plan does not offer the
layout, and one line on stderr says why. The values are ``F.linear``'s to float rounding.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from filelock import FileLock

from treespark.kernels.machine import hardware_name

# the products (gemv.c), the decoder-layer blocks built on them (blocks.c), the greedy
# rounds' draft trees (waves.c), the prefill chunks' attention (chunks.c) and the
# per-step allocation's argmax (best.c) and the logits' argmax (vocab.c), one library
SOURCES = tuple(Path(__file__).with_name(f) for f in ("gemv.c", "blocks.c", "waves.c", "chunks.c", "best.c",
                                                      "vocab.c"))
HEADERS = (Path(__file__).with_name("vexp.h"), Path(__file__).with_name("tiles.h"))   # what the sources include (in the build's key)
CACHE_DIR = Path.home() / ".cache" / "treespark" / "kernels"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
MAX_ROWS = 16  # the most rows ``native_linear`` takes: W's 4-row block stays in L1 over them
PANEL = 16     # the rows of a bfloat16 panel (``to_panels``)
PROFILER_NAME = "treespark::native_linear"  # what torch.profiler calls a product run here


def _compiler() -> tuple[str, str] | None:
    """(path, version line) of the C compiler, or None."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return cc, out.splitlines()[0] if out else ""


def build(cache_dir: Path = CACHE_DIR, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library for this machine, compiled if not cached; RuntimeError if it
    cannot be. ``extra_flags`` after ``FLAGS`` (tests: ``-mno-avx512f`` builds the AVX2 form
    on a machine that has AVX-512)."""
    found = _compiler()
    if found is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    cc, version = found
    flags = (*FLAGS, *extra_flags)
    texts = [src.read_text() for src in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\n".join([*texts, hardware_name(), version, *flags]).encode()).hexdigest()[:16]
    lib = Path(cache_dir) / f"gemv-{key}.so"
    lib.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lib) + ".lock"):
        if not lib.exists():
            tmp = lib.with_suffix(".tmp.so")
            includes = sorted({f"-I{h.parent}" for h in HEADERS})
            done = subprocess.run([cc, *flags, *includes, *map(str, SOURCES), "-o", str(tmp), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
            tmp.replace(lib)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel (built on first use), or None where it cannot be built; says why once."""
    try:
        return load(build())
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"[treespark.kernels.native] native products unavailable: {e}", file=sys.stderr, flush=True)
        return None


@functools.cache
def build_id() -> str | None:
    """The native kernels as this process runs them: the library's build (its file name
    hashes source, compiler, flags and machine) and whether its bfloat16 panels are AMX
    tiles; None without the library. What cached product plans and step-cost tables are
    keyed by."""
    lib = library()
    return None if lib is None else build().stem + ("+tiles" if lib.ts_tiles() else "")


def pointer(a: torch.Tensor | np.ndarray | None) -> int | None:
    """The address a native call takes for a tensor's or an array's data (None for None)."""
    if a is None:
        return None
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data


def as_long(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the contiguous int64 a native call reads: itself where it is (no operator
    called), else a converted copy."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def operator(name: str):
    """A native call as an operator to the profiler, as torch's own are (host-share figures
    count operator time); no annotation's cost when no profiler runs."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled \
        else contextlib.nullcontext()


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions typed."""
    lib = ctypes.CDLL(str(path))
    ptr, f32, f64, n, i32 = ctypes.c_void_p, ctypes.c_float, ctypes.c_double, ctypes.c_long, ctypes.c_int
    signatures = {
        "ts_gemv": [ptr] * 4 + [n] * 3 + [i32],
        "ts_gemv_panels": [ptr] * 4 + [n] * 3 + [i32],
        "ts_tiles": [],
        "ts_panel_tiles": [n],
        "ts_attn_in": [ptr, ptr, ptr, f32, ptr, ptr, i32, ptr, f32] + [ptr] * 5 + [n] * 5 + [i32],
        "ts_attn_out_mlp": [ptr, ptr, ptr, ptr, ptr, f32, ptr, ptr, ptr, ptr, i32] + [ptr] * 5 + [n] * 4 + [i32],
        "ts_add_norm": [ptr, ptr, ptr, f32, ptr, ptr, n, n, i32],
        "ts_norm_linear": [ptr, ptr, f32, ptr, ptr, i32, ptr, n, n, n, i32],
        "ts_context_write": [ptr, ptr, f32, ptr, i32, ptr, f32, ptr, ptr, n, ptr, ptr, ptr, ptr] + [n] * 6 + [i32],
        "ts_qk_rope": [ptr, ptr, f32, ptr, ptr] + [n] * 4 + [i32],
        "ts_silu_rows": [ptr, ptr, n, n, i32],
        "ts_paged_attention": [ptr] * 4 + [n, n, ptr, n, f32, ptr, ptr] + [n] * 6 + [i32],
        "ts_layers": [ptr, n, i32, ptr, ptr, ptr, n, ptr, n, ptr, ptr, ptr, ptr, n, ptr, ptr]
                     + [n, n, ptr, ptr, n, f32, n, n, n, ptr, n, ptr, n, f32] + [n] * 6 + [i32],
        "ts_chunk_attention": [ptr] * 4 + [n, n, ptr, n, f32, ptr] + [n] * 4 + [i32],
        "ts_chunk_lanes": [],
        "ts_greedy_forest": [ptr, n, n, ptr, n, ptr, ptr, n] + [ptr] * 7 + [n, f64, n] + [ptr] * 9 + [n] + [ptr] * 3 + [i32],
        "ts_best": [ptr, ptr, n, n, f64, ptr, ptr, f64, f64, ptr, ptr, ptr],
        "ts_argmax_rows": [ptr, n, n, ptr, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = i32, argtypes
    lib.ts_chunk_lanes.restype = n
    lib.ts_tiles()   # AMX's tile registers asked for once, before any product (gemv.c)
    return lib


def can_panel(weight: torch.Tensor) -> bool:
    """Whether ``to_panels`` takes this weight: a CPU matrix of a multiple of ``PANEL`` rows."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[0] % PANEL == 0 and weight.numel() > 0


def is_bf16_valued(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a float32 CPU tensor every value of which is a bfloat16 value
    (its low 16 bits zero), so that a bfloat16 copy holds it exactly. (The low halves are
    the even 16-bit words: a little-endian CPU, as x86 and Arm are.)"""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return False
    low = weight.detach().contiguous().view(torch.int16).view(-1)[0::2]
    return not bool(low.any())


def exact_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s bfloat16 copy in panels (``to_panels``) where it holds every value
    exactly (``is_bf16_valued``: a target at ``precision: bfloat16``, a drafter stored in
    bfloat16): the same products at half the bytes; None otherwise."""
    return to_panels(weight) if can_panel(weight) and is_bf16_valued(weight) else None


@functools.cache
def tiled(k: int) -> bool:
    """Whether the panels of a weight of ``k`` columns are AMX tiles (``gemv.c``:
    ``ts_panel_tiles``, where the CPU has AMX and the OS lets us use it)."""
    lib = library()
    return lib is not None and bool(lib.ts_panel_tiles(k))


def to_panels(weight: torch.Tensor, tiles: bool | None = None) -> torch.Tensor:
    """``weight`` [N, K] (bfloat16 values) as the bfloat16 copy ``native_linear`` reads: [N, K],
    its memory in panels of ``PANEL`` rows (``gemv.c``): panel j is rows 16j..16j+15, either
    k-major, the 16 weights of one k interleaved as row 16j+c, row 16j+8+c, or, as AMX tiles
    (``tiles``, default ``tiled(K)``), pairs of k major, row 16j+c's weights at k = 2p, 2p + 1
    side by side."""
    if not can_panel(weight):
        raise ValueError(f"bfloat16 panels need a CPU matrix of a multiple of {PANEL} rows, "
                         f"got {tuple(weight.shape)} on {weight.device.type}")
    n, k = weight.shape
    half = weight.detach().to(torch.bfloat16)
    if tiled(k) if tiles is None else tiles:
        return half.view(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).reshape(n, k)
    return half.view(n // PANEL, 2, PANEL // 2, k).permute(0, 3, 2, 1).reshape(n, k)


def from_panels(panels: torch.Tensor, tiles: bool | None = None) -> torch.Tensor:
    """``to_panels``' inverse (``tiles`` the same): the bfloat16 matrix [N, K] row-major."""
    n, k = panels.shape
    if tiled(k) if tiles is None else tiles:
        return panels.view(n // PANEL, k // 2, PANEL, 2).permute(0, 2, 1, 3).reshape(n, k)
    return panels.view(n // PANEL, k, PANEL // 2, 2).permute(0, 3, 2, 1).reshape(n, k)


def can_run(weight: torch.Tensor) -> bool:
    """Whether ``native_linear`` takes this weight: a contiguous float32 CPU matrix or a
    bfloat16 one in panels (``to_panels``), and the kernel built."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and can_panel(weight)))
            and library() is not None)


def most_rows(weight: torch.Tensor) -> int | None:
    """The most rows ``native_linear`` multiplies ``weight`` by: ``MAX_ROWS``, or any (None)
    for bfloat16 panels in tile form (``tiled``: compute-bound past 16 rows, and there AMX's)."""
    return None if weight.dtype == torch.bfloat16 and weight.dim() == 2 and tiled(weight.shape[1]) else MAX_ROWS


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 ``x`` [..., in]: by ``gemv.c`` for up to
    ``most_rows`` rows and a weight ``can_run`` takes (a bfloat16 one is ``to_panels``'
    copy, widened exactly); a float32 weight by ``F.linear`` otherwise (no gradients);
    float32 out. ValueError for panels it cannot run (they are no matrix for ``F.linear``)."""
    k, n = weight.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    most = most_rows(weight)
    if not 1 <= m <= (most or m) or x.dtype != torch.float32 or not can_run(weight):
        if weight.dtype == torch.bfloat16:
            raise ValueError(f"native_linear runs bfloat16 panels {tuple(weight.shape)} by 1 to {most} "
                             f"float32 rows, not {m} {x.dtype} rows")
        return F.linear(x, weight, bias)
    rows = x.reshape(m, k).contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    args = (rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
            torch.get_num_threads())
    fn = library().ts_gemv if weight.dtype == torch.float32 else library().ts_gemv_panels
    with operator(PROFILER_NAME):
        rc = fn(*args)
    if rc != 0:
        raise ValueError(f"ts_gemv refused rows {m}, out {n}, in {k}")
    return y.view(*x.shape[:-1], n)

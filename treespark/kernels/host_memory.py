"""Host memory for a CPU engine: what a step frees, the next step reuses.

glibc's malloc serves a large block (over a threshold that moves up to 32 MB) with a
mapping of its own and unmaps it on free. A step at a large vocabulary makes
vocabulary-sized temporaries (at V = 151,936, a few dozen rows of float32 or float64 are
tens of MB each: the wave's scores, the T > 0 walk's rows), so each was fresh pages,
faulted in by the operator writing it and unmapped where Python dropped it: at batch 32
with trees of 32 at T = 1 on the tiny Qwen3 pair, a step took 3.6 s with that and 2.3 s
without (``treespark bench rounds --host``; on a GPU the caching allocator keeps device
memory the same way). ``keep_freed_memory`` serves every block from the heap and never trims it
below 2 GB free at its top, so freed blocks are reused: not always at once (an aligned
request asks a little more than the block it freed, and a small block allocated after it
can hold it apart from the heap's top; a loop of one 40 MB temporary faulted it in afresh
for up to six rounds before settling), then without a page faulted. The cost: the
process keeps the memory its largest steps took, as a serving process keeps its KV pool,
and more where blocks of many sizes share the heap (a loop of 320 MB and 107 MB
temporaries settled at 967 MB resident, where unmapping them kept it at 220 MB; it did
not grow over 100 rounds). glibc only (``mallopt``); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import platform

M_TRIM_THRESHOLD = -1   # mallopt's parameters (malloc.h)
M_MMAP_MAX = -4
TRIM_BYTES = 2**31 - 1  # the largest value mallopt takes (a C int)


@functools.cache
def keep_freed_memory() -> bool:
    """Set this process's malloc to keep what it frees (the module docstring), once; True
    where it did (glibc), False where nothing changed."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1

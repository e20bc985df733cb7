"""``torch.compile`` for the step's device functions: the target forward's layer ops
(``treespark.kernels.layer_ops``) and a depth of the T > 0 walk
(``treespark.spec.walk.walk_level``), when ``EngineConfig.compile_backend`` names a
backend.

On a GPU each of those is dozens of small kernels launched one by one from Python;
compiled (``inductor``), each is a few fused kernels. Shapes are dynamic (one graph
serves every row count, token count and vocabulary), apart from torch's own
specialisation of sizes 0 and 1 and what a function's Python branches on (the walk's
branching C, Qwen3's q/k norms). A replica compiles each graph on the first step that
needs it; inductor keeps what it compiled on disk, so a restarted replica compiles faster.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable, backend: str) -> Callable:
    """``fn`` compiled by ``torch.compile(backend=backend)``, once per process, function
    and backend (fullgraph: a graph break is an error, not a silent slow path)."""
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)

"""Which matrix product is fastest for the verify forward's small row counts?

Times ``F.linear(x, W)`` against ``(W @ x.T).T`` on the target's own weight shapes
for 1..64 rows, side by side in one run. ``TargetRunner`` uses W @ x^T up to
``SMALL_ROWS`` rows on CPU; this benchmark is how that threshold was chosen.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from treespark.bench.common import markdown_table
from treespark.models import ModelPair


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


@torch.no_grad()
def linear_benchmark(pair: ModelPair, rows=(1, 2, 4, 8, 16, 32, 64), reps: int = 20, log=print) -> str:
    layer = pair.target.model.layers[0]
    shapes = {"q_proj": layer.self_attn.q_proj.weight, "mlp.gate": layer.mlp.gate_proj.weight,
              "mlp.down": layer.mlp.down_proj.weight}
    out = []
    for n in rows:
        cells = [str(n)]
        for name, w in shapes.items():
            x = torch.randn(n, w.shape[1], dtype=w.dtype, device=w.device)
            a = _time(lambda x=x, w=w: F.linear(x, w), reps)
            b = _time(lambda x=x, w=w: (w @ x.T).T, reps)
            cells.append(f"{a * 1e6:.0f} / {b * 1e6:.0f} ({a / b:.2f}x)")
            log(f"rows={n:>3} {name:>9}: F.linear {a * 1e6:7.0f} us   W@x^T {b * 1e6:7.0f} us")
        out.append(cells)
    header = ["rows"] + [f"{k} {tuple(v.shape)}: linear / W@x^T us (speed-up)" for k, v in shapes.items()]
    return markdown_table(header, out)

"""How long a replica's startup step-cost table takes to measure (no cache): the default
pair as configs/cluster.yaml serves it (batch 8, context 1024, one torch thread).

    python -m loadtests.startup_costs --runs 3
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    import treespark
    from treespark.engine.config import EngineConfig
    from treespark.engine.core import Engine
    from treespark.engine.step_costs import startup_step_costs

    torch.set_num_threads(args.threads)
    engine = Engine(treespark.load_pair(progress=False), EngineConfig(max_batch_size=8, max_context=1024))
    for i in range(args.runs):
        t0 = time.perf_counter()
        table = startup_step_costs(engine, cache_dir=None)
        print(f"run {i}: {time.perf_counter() - t0:.1f} s (T(1, 1) {1e3 * table.verify.time(1, 1):.1f} ms)",
              flush=True)


if __name__ == "__main__":
    main()

"""Per-round traces for the serving simulator: for each tree size, the draft tokens the
target accepted in real rounds (``record_traces``: the engine on held-out prompts under
several budgets), or synthetic ones drawn from an acceptance profile."""

from __future__ import annotations

import bisect
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from treespark.pricing.costmodel import AcceptanceProfile
from treespark.spec.budget import Budget


@dataclass(frozen=True)
class Traces:
    """Accepted draft tokens of recorded rounds, by tree size."""

    by_size: dict[int, tuple[int, ...]]
    source: str = ""

    def sizes(self) -> list[int]:
        return sorted(self.by_size)

    def sample(self, n: int, rng: random.Random) -> int:
        """An accepted length for an ``n``-node tree: from the largest recorded size <= n."""
        if n <= 0:
            return 0
        sizes = self.sizes()
        i = bisect.bisect_right(sizes, n) - 1
        if i < 0:
            return 0
        return rng.choice(self.by_size[sizes[i]])

    def mean(self, n: int) -> float:
        xs = self.by_size.get(n, ())
        return sum(xs) / len(xs) if xs else math.nan

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"source": self.source,
                                    "by_size": {str(k): list(v) for k, v in sorted(self.by_size.items())}}) + "\n")

    @classmethod
    def load(cls, path: Path) -> Traces:
        d = json.loads(Path(path).read_text())
        return cls({int(k): tuple(int(x) for x in v) for k, v in d["by_size"].items() if v}, d.get("source", ""))

    @classmethod
    def synthetic(cls, profile: AcceptanceProfile, rounds: int = 400, seed: int = 0) -> Traces:
        """Poisson draws with the profile's mean per size (capped at the size): a stand-in
        until real traces are recorded."""
        rng = random.Random(seed)

        def poisson(lam: float) -> int:
            k, p, limit = 0, 1.0, math.exp(-lam)
            while True:
                p *= rng.random()
                if p < limit:
                    return k
                k += 1

        return cls({n: tuple(min(poisson(profile(n)), n) for _ in range(rounds))
                    for n in range(1, profile.max_nodes + 1)}, "synthetic")


def record_traces(pair, budgets: list[Budget], n_prompts: int, max_tokens: int, batch_size: int,
                  log=print) -> Traces:
    """Run the engine on held-out prompts under each budget; keep (tree size, accepted)."""
    from treespark.engine.run import run_engine
    from treespark.models.prompts import pair_prompts

    prompts = pair_prompts(pair, n_prompts)
    by: dict[int, list[int]] = {}
    for b in budgets:
        r = run_engine(pair, prompts, b, max_tokens=max_tokens, batch_size=batch_size)
        for s in r.step_stats:
            for n, a in zip(s.tree_sizes, s.accepted, strict=True):
                by.setdefault(n, []).append(a)
        log(f"budget {b}: tau {r.tau:.2f}, {r.tokens_per_s:.1f} tok/s")
    return Traces({n: tuple(v) for n, v in by.items() if n > 0}, getattr(pair, "name", ""))

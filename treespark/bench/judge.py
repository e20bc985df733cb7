"""The table ``treespark judge-drafter`` prints."""

from __future__ import annotations

from treespark.bench.common import markdown_table
from treespark.training.judge import Judgement


def judgement_table(rows: dict[str, Judgement]) -> str:
    """One markdown table: per-offset agreement and simulated chain tau, a row per label."""
    blk = len(next(iter(rows.values())).agreement)
    header = ["drafter", "answers (anchors)", *[f"agree @{k}" for k in range(1, blk + 1)],
              *[f"tau chain {k}" for k in range(1, blk + 1)]]
    body = [[name, f"{j.sequences} ({j.anchors})", *[f"{a:.3f}" for a in j.agreement],
             *[f"{t:.3f}" for t in j.chain_tau]] for name, j in rows.items()]
    return markdown_table(header, body)

"""What one decode step reports (``StepStats``): built from the step's rows, their drafted
trees and verification results, its stage clocks and its host transfers."""

from __future__ import annotations

from collections.abc import Sequence

from treespark.engine.request import Request
from treespark.spec.budget import Budget
from treespark.spec.drafting import RoundDraft
from treespark.spec.params import StepStats
from treespark.spec.verify import VerifyResult


def step_stats(batch: Sequence[Request], drafted: RoundDraft, results: Sequence[VerifyResult],
               budgets: Sequence[Budget], *, theta: float, times: tuple[float, float, float, float],
               prefill_tokens: int, host: tuple[int, int, int, int], policy_s: float) -> StepStats:
    """``times``: the step's start, drafting start, verify start and end (perf_counter);
    ``host``: (syncs, elements copied to the host, uploads, elements uploaded). Calibration records are split by
    regime: T = 0 rows' and T > 0 rows' verified by the rejection walk (a reproducible row's
    acceptance follows another coupling, so its records would bias the walk's map: none)."""
    t0, t_draft, t_verify, t_end = times
    trees = drafted.trees
    return StepStats(
        batch_size=len(batch),
        tokens_verified=sum(t.num_nodes for t in trees),
        tree_sizes=tuple(t.size for t in trees),
        depths=tuple(t.depth for t in trees),
        widths=tuple(t.width for t in trees),
        accepted=tuple(r.accepted for r in results),
        theta=theta,
        draft_s=t_verify - t_draft,
        verify_s=t_end - t_verify,
        step_s=t_end - t0,
        prefill_tokens=prefill_tokens,
        calibration_records=tuple(x for req, r in zip(batch, results, strict=True)
                                  if req.params.temperature == 0 for x in r.records),
        sampled_records=tuple(x for req, r in zip(batch, results, strict=True)
                              if req.params.temperature > 0 and not req.params.keyed for x in r.records),
        node_caps=tuple(b.node_cap for b in budgets),
        draft_waves=drafted.waves,
        host_syncs=host[0],
        host_elements=host[1],
        host_uploads=host[2],
        policy_s=policy_s,
    )

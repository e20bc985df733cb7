"""The step-cost table corrected online from the replica's own measured steps.

A replica measures its table alone, before traffic (``treespark.engine.step_costs``). In
service it shares the machine (the proxy, the router, the load generator, other
replicas), and its steps carry host work the bare forward never timed. A uniform
slowdown changes no allocation (the goodput ``tokens / seconds`` of every choice
scales alike), but a non-uniform one does: drafting dearer than the table says, or
every verified token dearer than the step's fixed part. ``CostFit`` learns three
factors from the steps the engine runs:

* ``draft``: measured drafting seconds / the table's (``draft_base + draft_row * bs +
  draft_node * drafted``), on steps that drafted;
* ``base`` and ``extra``: the verify stage (forward, acceptance, commit) regressed as

      measured = base * T(bs, 1) + extra * (T(bs, k + 1) - T(bs, 1) + h * nodes)

  in relative terms (both sides divided by the table's whole prediction, so a step of
  16 rows weighs as much as a step of 1), with ridge priors: ``base`` toward 1 and
  ``extra`` toward ``base`` (a machine uniformly slower than its table is the first
  guess), each worth ``prior`` (0.1) steps spent wholly in that part (a step whose draft
  nodes are a fifth of its predicted time counts 1/25 toward ``extra``). Plain steps
  alone identify ``base``; only steps that verify drafted nodes move ``extra`` away
  from it.

Past steps fade by ``decay`` per step, so the factors follow the load. Each step's
measured seconds are clipped to within a factor ``clip`` of what the current factors
predict: one step stalled by a garbage collection or a preemption does not set the
price, while a table far off is still corrected, ``clip`` at a time.

numpy only: tested without a model, runnable in the control plane.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from treespark.pricing.allocate import StepCosts


@dataclass(frozen=True)
class StepPrediction:
    """What the table predicts for one decode step, in seconds, split as ``CostFit``
    corrects it."""

    draft: float      # drafting (0: the step did not draft)
    base: float       # the plain forward T(bs, 1)
    extra: float      # the verified draft nodes: T(bs, k + 1) - T(bs, 1) + h * nodes


def predict_step(costs: StepCosts, batch_size: int, drafted_nodes: int, drafted: bool,
                 verified: tuple[int, ...]) -> StepPrediction:
    """The table's prediction for a decode step of ``batch_size`` rows that drafted
    ``drafted_nodes`` nodes (``drafted``: the drafter ran at all) and verified
    ``verified[r]`` draft nodes of row r."""
    row = costs.verify_row(max(batch_size, 1))
    pad = min(max(verified, default=0), costs.max_nodes)
    draft = costs.drafting_s(batch_size, drafted_nodes) if drafted else 0.0
    return StepPrediction(draft, float(row[0]), float(row[pad] - row[0]) + costs.node_s * sum(verified))


@dataclass
class CostFit:
    """Online factors on a step-cost table (see the module docstring)."""

    decay: float = 0.99          # weight of the past per observed step (~100 steps of memory)
    prior: float = 0.1           # each prior's weight, in steps spent wholly in its part
    clip: float = 4.0            # one step's seconds are clipped to within this factor of the fit's prediction
    steps: int = 0               # steps observed
    _draft: np.ndarray = field(default_factory=lambda: np.zeros(2))        # decayed [sum w * ratio, sum w]
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((2, 2)))    # decayed X'WX of (base, extra) shares
    _rhs: np.ndarray = field(default_factory=lambda: np.zeros(2))          # decayed X'Wy

    def observe(self, predicted: StepPrediction, draft_s: float, verify_s: float) -> None:
        """One decode step: the table's ``predicted`` split and the measured stage seconds."""
        d = self.decay
        self._draft *= d
        self._gram *= d
        self._rhs *= d
        self.steps += 1
        c = self.clip
        if predicted.draft > 0:
            f = self.draft
            self._draft += (float(np.clip(draft_s / predicted.draft, f / c, f * c)), 1.0)
        whole = predicted.base + predicted.extra
        if whole > 0:
            x = np.array([predicted.base, predicted.extra]) / whole
            now = float(x @ np.array(self.verify_factors()))
            y = float(np.clip(verify_s / whole, now / c, now * c))
            self._gram += np.outer(x, x)
            self._rhs += x * y

    @property
    def draft(self) -> float:
        """Measured / table drafting seconds (1.0 before any drafting step)."""
        s, w = self._draft
        return float((s + self.prior) / (w + self.prior))

    def verify_factors(self) -> tuple[float, float]:
        """(base, extra): the ridge solution, ``base`` pulled to 1, ``extra`` to ``base``."""
        p = self.prior
        # penalty p * (base - 1)^2 + p * (extra - base)^2
        a = self._gram + p * np.array([[2.0, -1.0], [-1.0, 1.0]])
        b = self._rhs + p * np.array([1.0, 0.0])
        base, extra = np.linalg.solve(a, b)
        return float(max(base, 1e-3)), float(max(extra, 1e-3))   # never a free forward

    def corrected(self, costs: StepCosts) -> StepCosts:
        """``costs`` (the table as measured) with the factors applied: drafting x
        ``draft``; T(bs, k + 1) as ``base * T(bs, 1) + extra * (T(bs, k + 1) - T(bs, 1))``;
        host seconds per verified node x ``extra``."""
        base, extra = self.verify_factors()
        draft = self.draft
        return replace(costs, node_s=costs.node_s * extra, base_scale=base, extra_scale=extra,
                       draft_base_s=costs.draft_base_s * draft, draft_row_s=costs.draft_row_s * draft,
                       draft_node_s=costs.draft_node_s * draft, _rows={})

"""The step-cost table corrected online from the replica's own measured steps.

A replica measures its table alone, before traffic (``treespark.engine.step_costs``). In
service it shares the machine (the proxy, the router, the load generator, other
replicas), and its steps carry host work the bare forward never timed. A uniform
slowdown changes no allocation (the goodput ``tokens / seconds`` of every choice
scales alike), but a non-uniform one does: drafting dearer than the table says, or
every verified token dearer than the step's fixed part. ``CostFit`` learns three
factors from the steps the engine runs:

* ``draft``: measured drafting seconds / the table's (``StepCosts.drafting_s``: by rows
  and the step's node cap), on steps that drafted;
* ``base`` and ``extra``: the verify stage (forward, acceptance, commit) regressed as

      measured = base * T(bs, 1) + extra * (T(bs, k + 1) - T(bs, 1) + h * nodes)

  in relative terms (both sides divided by the table's whole prediction, so a step of
  16 rows weighs as much as a step of 1), with ridge priors: ``base`` toward 1 and
  ``extra`` toward ``base`` (a machine uniformly slower than its table is the first
  guess), each worth ``prior`` (0.1) steps spent wholly in that part (a step whose draft
  nodes are a fifth of its predicted time counts 1/25 toward ``extra``). Plain steps
  alone identify ``base``; only steps that verify drafted nodes move ``extra`` away
  from it.

On top of the three factors, each row count gets its own residual ``rows[bs]``: the
verify seconds measured on steps of ``bs`` rows over what the factors, as they stood
at each step, predicted for them, relative to the same over all row counts (a table
whose 4-row cell was timed in a quiet moment is corrected there alone).

Guards (``guard``, pure):

* drift: past steps fade by ``decay`` per step (the factors, ~100 steps of memory) and by
  ``cell_decay`` per step (the per-cell sums, ~500), so the correction follows the load;
* too few samples: a factor is used only once its decayed weight reaches
  ``min_samples`` steps (drafting steps for ``draft``, any step for ``base`` and
  ``extra``, steps of that row count for ``rows[bs]``); below, it is 1: the table;
* how far: every factor is bounded to ``[1 / bound, bound]`` of the table;
* one step: its measured seconds are clipped to within a factor ``clip`` of what the
  current factors predict: one step stalled by a garbage collection or a preemption does
  not set the price, while a table far off is still corrected, ``clip`` at a time.

``cells()`` reports, per (row count, verified-node bin), the decayed mean step seconds
the startup table predicts, the corrected table predicts, and the engine measured.

numpy only: tested without a model, runnable in the control plane.
"""

from __future__ import annotations

import math
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


def predict_step(costs: StepCosts, batch_size: int, drafted_cap: int,
                 verified: tuple[int, ...]) -> StepPrediction:
    """The table's prediction for a decode step of ``batch_size`` rows that drafted under
    a node cap of ``drafted_cap`` a row (0: the drafter did not run) and verified
    ``verified[r]`` draft nodes of row r."""
    row = costs.verify_row(max(batch_size, 1))
    pad = min(max(verified, default=0), costs.max_nodes)
    draft = costs.drafting_s(batch_size, drafted_cap)
    return StepPrediction(draft, float(row[0]), float(row[pad] - row[0]) + costs.node_s * sum(verified))


def guard(factor: float, samples: float, *, min_samples: float, bound: float) -> float:
    """``factor`` as used on the table: 1 below ``min_samples`` (decayed) samples, else
    bounded to ``[1 / bound, bound]``."""
    assert bound >= 1.0 and min_samples >= 0.0
    if samples < min_samples or not math.isfinite(factor):
        return 1.0
    return min(max(factor, 1.0 / bound), bound)


def node_bin(nodes: int) -> int:
    """The lower edge of ``nodes``'s bin: 0, 1, 2-3, 4-7, 8-15, ... (powers of two)."""
    return 0 if nodes <= 0 else 1 << (nodes.bit_length() - 1)


@dataclass(frozen=True)
class Factors:
    """The correction as applied (guarded): drafting, the verify stage's fixed part and
    its per-node part, and each row count's residual (absent: 1)."""

    draft: float = 1.0
    base: float = 1.0
    extra: float = 1.0
    rows: dict[int, float] = field(default_factory=dict)

    def step_s(self, bs: int, p: StepPrediction) -> float:
        """A step's seconds on the corrected table, from the startup table's split ``p``."""
        return self.draft * p.draft + self.rows.get(bs, 1.0) * (self.base * p.base + self.extra * p.extra)


@dataclass(frozen=True)
class CostCell:
    """Steps of ``rows`` rows that verified ``nodes`` .. 2 * ``nodes`` - 1 draft nodes
    (0: plain): decayed step count and mean step seconds (drafting + verify) as the
    startup table predicts, as the corrected table predicts, and as measured."""

    rows: int
    nodes: int
    steps: float
    table_s: float
    corrected_s: float
    measured_s: float


@dataclass
class CostFit:
    """Online factors on a step-cost table (see the module docstring)."""

    decay: float = 0.99          # weight of the past per observed step (~100 steps of memory)
    prior: float = 0.1           # each prior's weight, in steps spent wholly in its part
    clip: float = 4.0            # one step's seconds are clipped to within this factor of the fit's prediction
    min_samples: float = 16.0    # decayed steps before a factor (or a row count's residual) is used
    bound: float = 4.0           # no factor moves the table by more than this factor, either way
    cell_decay: float = 0.998    # weight of the past per step in the per-cell sums (~500 steps)
    steps: int = 0               # steps observed
    _draft: np.ndarray = field(default_factory=lambda: np.zeros(2))        # decayed [sum w * ratio, sum w]
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((2, 2)))    # decayed X'WX of (base, extra) shares
    _rhs: np.ndarray = field(default_factory=lambda: np.zeros(2))          # decayed X'Wy
    _weight: float = 0.0                                                   # decayed steps seen by the verify fit
    # (rows, node bin) -> [step, w, draft, base, extra (the table's), measured draft, measured verify, verify as
    # the factors predicted it then, measured verify clipped], sums decayed by ``cell_decay`` per step, lazily (to
    # ``step`` when next touched)
    _cells: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def observe(self, predicted: StepPrediction, draft_s: float, verify_s: float, *, rows: int = 1,
                nodes: int = 0) -> None:
        """One decode step of ``rows`` rows that verified ``nodes`` draft nodes: the table's
        ``predicted`` split and the measured stage seconds."""
        d = self.decay
        self._draft *= d
        self._gram *= d
        self._rhs *= d
        self._weight *= d
        self.steps += 1
        c = self.clip
        if predicted.draft > 0:
            f = self.draft
            self._draft += (float(np.clip(draft_s / predicted.draft, f / c, f * c)), 1.0)
        base, extra = self.verify_factors()
        fitted = base * predicted.base + extra * predicted.extra    # what the factors predicted before this step
        clipped = float(np.clip(verify_s, fitted / c, fitted * c))
        whole = predicted.base + predicted.extra
        if whole > 0:
            x = np.array([predicted.base, predicted.extra]) / whole
            self._gram += np.outer(x, x)
            self._rhs += x * clipped / whole
            self._weight += 1.0
        cell = self._cell(rows, node_bin(nodes))
        cell[1:] = [a + b for a, b in zip(cell[1:], (1.0, predicted.draft, predicted.base, predicted.extra,
                                                       draft_s, verify_s, fitted, clipped), strict=True)]

    def _cell(self, rows: int, nodes: int) -> list[float]:
        """The cell's sums, decayed to now and stored (the engine's side: ``observe``)."""
        c = self._cells.setdefault((rows, nodes), [float(self.steps)] + [0.0] * 8)
        c[:] = self._decayed(c)
        return c

    def _decayed(self, c: list[float]) -> list[float]:
        """A copy of the cell's sums decayed to now: the readers' side (a heartbeat thread
        reads while the engine's thread observes; readers never write)."""
        f = self.cell_decay ** (self.steps - c[0])
        return [float(self.steps)] + [x * f for x in c[1:]]

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

    def factors(self) -> Factors:
        """The correction as applied, guarded (see the module docstring)."""
        g = dict(min_samples=self.min_samples, bound=self.bound)
        base, extra = self.verify_factors()
        base, extra = guard(base, self._weight, **g), guard(extra, self._weight, **g)
        draft = guard(self.draft, float(self._draft[1]), **g)
        by_rows: dict[int, np.ndarray] = {}
        for (bs, _), c in list(self._cells.items()):
            c = self._decayed(c)
            by_rows[bs] = by_rows.get(bs, 0.0) + np.array([c[1], c[7], c[8]])
        # measured over what the factors of each step's time predicted, over the same for all row counts: what
        # sets this row count apart (the factors carry the common level, and the lag of a drift they followed)
        total = sum(by_rows.values(), np.zeros(3))
        level = total[2] / total[1] if total[1] > 0 else 1.0
        rows = {}
        for bs, (w, fitted, clipped) in by_rows.items():
            r = guard(clipped / fitted / level if fitted > 0 else 1.0, w, **g)
            if r != 1.0:
                rows[bs] = r
        return Factors(draft, base, extra, rows)

    def cells(self) -> list[CostCell]:
        """Per (rows, node bin), by rows then nodes: the decayed step count and mean step
        seconds as the startup table predicts, as the corrected table predicts, as measured."""
        f = self.factors()
        out = []
        for (bs, nb), c in sorted(self._cells.items()):
            _, w, pd, pb, pe, md, mv, _, _ = self._decayed(c)
            if w <= 0:
                continue
            mean = StepPrediction(pd / w, pb / w, pe / w)
            out.append(CostCell(bs, nb, w, mean.draft + mean.base + mean.extra, f.step_s(bs, mean), (md + mv) / w))
        return out

    def corrected(self, costs: StepCosts) -> StepCosts:
        """``costs`` (the table as measured) with the guarded factors applied: drafting x
        ``draft``; T(bs, k + 1) as ``rows[bs] * (base * T(bs, 1) + extra * (T(bs, k + 1) -
        T(bs, 1)))``; host seconds per verified node x ``extra``."""
        f = self.factors()
        return replace(costs, node_s=costs.node_s * f.extra, base_scale=f.base, extra_scale=f.extra,
                       row_scale=dict(f.rows), draft_scale=f.draft)


def served_ratios(cells: list[CostCell]) -> tuple[float, float] | None:
    """(corrected / startup, measured / startup): the step-weighted mean step seconds of
    ``cells`` as the corrected table prices them and as measured, over the startup
    table's; None without steps."""
    w = sum(c.steps for c in cells)
    table = sum(c.steps * c.table_s for c in cells)
    if w <= 0 or table <= 0:
        return None
    return sum(c.steps * c.corrected_s for c in cells) / table, sum(c.steps * c.measured_s for c in cells) / table

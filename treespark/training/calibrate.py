"""``treespark calibrate``: fit the drafter's calibration on verification traces of the
tuning prompts, report ECE / Brier / log-loss, store calibration.json and plot it."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from treespark.engine.run import run_engine
from treespark.models.pair import ModelPair
from treespark.models.prompts import pair_prompts
from treespark.spec.budget import DEFAULT_BRANCH_CAP, Budget
from treespark.spec.calibration import (
    Calibration,
    CalibrationReport,
    calibrate,
    offsets_in_use,
    p_hat_of,
)


def collect_records(pair: ModelPair, prompts, *, temperature: float, max_tokens: int,
                    budget: Budget) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N] q, [N] accepted, [N] sibling rank of every edge below an accepted node, from
    real verification rounds at ``temperature``."""
    r = run_engine(pair, prompts, budget, max_tokens=max_tokens, batch_size=8, temperature=temperature)
    recs = [rec for s in r.step_stats
            for rec in (s.calibration_records if temperature == 0 else s.sampled_records)]
    q = np.array([x for x, _, _ in recs], dtype=np.float64)
    y = np.array([a for _, a, _ in recs], dtype=bool)
    rank = np.array([j for _, _, j in recs], dtype=np.int64)
    return q, y, rank


@dataclass(frozen=True)
class RegimeFit:
    """One temperature regime's records and its two fits: (a, b) alone and with offsets."""

    label: str
    q: np.ndarray
    y: np.ndarray
    rank: np.ndarray
    plain: CalibrationReport
    ranked: CalibrationReport

    def chosen(self, sibling_offsets: bool) -> CalibrationReport:
        return self.ranked if sibling_offsets else self.plain


def reliability_png(fits: list[RegimeFit], offsets: tuple[bool, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(fits), figsize=(4.5 * len(fits), 4.5), squeeze=False)
    for ax, f, o in zip(axes[0], fits, offsets, strict=True):
        report = f.chosen(o)
        for label, p in (("raw q", f.q), ("calibrated p_hat", p_hat_of(report.calibration, f.q, f.rank))):
            idx = np.minimum((p * 10).astype(np.int64), 9)
            xs, ys = [], []
            for b in range(10):
                m = idx == b
                if int(m.sum()) >= 20:
                    xs.append(float(p[m].mean()))
                    ys.append(float(f.y[m].mean()))
            ax.plot(xs, ys, marker="o", label=label)
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set(xlabel="predicted acceptance", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1),
               title=f"{f.label}: ECE {report.ece_before:.3f} -> {report.ece_after:.3f} (n={report.n})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report_fields(r: CalibrationReport) -> dict:
    return {"n": r.n, "ece_before": round(r.ece_before, 4), "ece_after": round(r.ece_after, 4),
            "brier_before": round(r.brier_before, 4), "brier_after": round(r.brier_after, 4),
            "log_loss_before": round(r.log_loss_before, 4), "log_loss_after": round(r.log_loss_after, 4)}


def calibrate_pair(pair: ModelPair, out_dir: Path, *, n_prompts: int = 48, max_tokens: int = 64,
                   sampled_temperature: float = 1.0, sibling_offsets: str = "sampled",
                   temperature_scale: float = 1.0, log=print) -> Calibration:
    """Fit the T = 0 map on greedy verification traces of the tuning prompts and the
    sampled map (used at every T > 0) on traces at ``sampled_temperature``, drafted at
    ``temperature_scale`` x T (``Calibration.temperature_scale``; default 1, the
    drafter's own q); each map both ways, (a, b) alone and with sibling-rank offsets.
    The records come from trees of the default branch cap (``DEFAULT_BRANCH_CAP``), so the
    ranks fitted are the ranks served. The maps in use (``sibling_offsets``, one of
    ``SIBLING_OFFSETS``) go to calibration.json with their reports; under ``variant``
    goes the pair of maps without offsets (or, if the maps in use have none, with
    offsets in both) for side-by-side benchmarks."""
    use = offsets_in_use(sibling_offsets)
    other = (False, False) if any(use) else (True, True)
    if not sampled_temperature > 0:
        raise ValueError(f"sampled_temperature must be > 0, got {sampled_temperature}")
    # the sampled map in force while drafting (a bad scale fails here, before any decoding)
    drafting = replace(pair, calibration=replace(
        pair.calibration, sampled=replace(pair.calibration.at(sampled_temperature), temperature_scale=temperature_scale)))
    prompts = pair_prompts(pair, n_prompts, split="tune")
    fits = []
    for t in (0.0, sampled_temperature):
        q, y, rank = collect_records(drafting, prompts, temperature=t, max_tokens=max_tokens,
                                     budget=Budget(0.0, 24, DEFAULT_BRANCH_CAP))
        if len(q) == 0:
            raise RuntimeError(f"no calibration records at T={t:g}: the drafter never drafted")
        plain, ranked = calibrate(q, y), calibrate(q, y, rank)
        if t > 0:  # the sampled map keeps the scale its records were drafted at
            plain, ranked = (replace(r, calibration=replace(r.calibration, temperature_scale=temperature_scale))
                             for r in (plain, ranked))
        fit = RegimeFit(f"T={t:g}", q, y, rank, plain, ranked)
        log(f"{fit.label}: {len(q)} edge records, acceptance {float(y.mean()):.3f}")
        for name, r in (("(a, b) alone", fit.plain), ("with sibling offsets", fit.ranked)):
            c = r.calibration
            log(f"  {name:>20}: a={c.a:.3f} b={c.b:.3f} c={[round(x, 3) for x in c.sibling_bias]}  ECE "
                f"{r.ece_before:.4f} -> {r.ece_after:.4f}  Brier {r.brier_before:.4f} -> {r.brier_after:.4f}  "
                f"log-loss {r.log_loss_before:.4f} -> {r.log_loss_after:.4f}")
        fits.append(fit)
    greedy, sampled = fits

    def combined(offsets: tuple[bool, bool]) -> Calibration:
        return replace(greedy.chosen(offsets[0]).calibration, sampled=sampled.chosen(offsets[1]).calibration)

    def with_reports(offsets: tuple[bool, bool]) -> dict:
        """The T = 0 map and its report, the sampled map and its report nested under "sampled"."""
        g, s = greedy.chosen(offsets[0]), sampled.chosen(offsets[1])
        return {**g.calibration.to_dict(), **_report_fields(g),
                "sampled": {**s.calibration.to_dict(), "temperature": sampled_temperature, **_report_fields(s)}}

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "calibration.json"
    path.write_text(json.dumps({**with_reports(use), "variant": with_reports(other)}, indent=2) + "\n")
    try:
        reliability_png(fits, use, out_dir / "reliability.png")
    except ImportError:
        log("matplotlib is not installed: no reliability diagram (pip install '.[loadtest]')")
    log(f"wrote {path} (sibling offsets: {sibling_offsets})")
    return combined(use)

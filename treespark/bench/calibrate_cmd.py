"""Fit the drafter's calibration on verification traces, report ECE/Brier, plot it."""

from __future__ import annotations

from pathlib import Path

import torch

from treespark.bench.common import bench_prompts, run_engine
from treespark.budget import Budget
from treespark.calibration import CalibrationReport, calibrate, p_hat_of
from treespark.models import ModelPair


def collect_records(pair: ModelPair, prompts, *, temperature: float, max_tokens: int,
                    budget: Budget) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, accepted, sibling rank) of every edge below an accepted node, from real
    verification rounds."""
    r = run_engine(pair, prompts, budget, max_tokens=max_tokens, batch_size=8, temperature=temperature)
    recs = [rec for s in r.step_stats for rec in s.calibration_records]
    q = torch.tensor([x for x, _, _ in recs], dtype=torch.float64)
    y = torch.tensor([a for _, a, _ in recs], dtype=torch.bool)
    rank = torch.tensor([j for _, _, j in recs], dtype=torch.long)
    return q, y, rank


def reliability_png(q: torch.Tensor, y: torch.Tensor, rank: torch.Tensor, report: CalibrationReport,
                    path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = torch.linspace(0, 1, 11)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for label, p in (("raw q", q), ("calibrated p_hat", p_hat_of(report.calibration, q, rank))):
        idx = (p * 10).long().clamp(max=9)
        xs, ys = [], []
        for b in range(10):
            m = idx == b
            if int(m.sum()) >= 20:
                xs.append(float(p[m].mean()))
                ys.append(float(y[m].double().mean()))
        ax.plot(xs, ys, marker="o", label=label)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    ax.set(xlabel="predicted acceptance", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1),
           title=f"ECE {report.ece_before:.3f} -> {report.ece_after:.3f} (n={report.n})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    del bins


def _summary(r: CalibrationReport) -> dict:
    return {**r.calibration.to_dict(), "ece": round(r.ece_after, 4), "brier": round(r.brier_after, 4),
            "log_loss": round(r.log_loss_after, 4)}


def calibrate_pair(pair: ModelPair, out_dir: Path, *, n_prompts: int = 48, max_tokens: int = 64,
                   temperatures=(0.0, 1.0), sibling_offsets: bool = False, log=print) -> CalibrationReport:
    """Fit both maps on the tuning prompts' verification traces: (a, b) alone and with
    sibling-rank offsets. The one in use (``sibling_offsets``) goes to calibration.json
    with its report; the other is stored under ``variant`` for side-by-side benchmarks."""
    prompts = bench_prompts(pair, n_prompts, split="tune")
    qs, ys, ranks = [], [], []
    for t in temperatures:
        q, y, rank = collect_records(pair, prompts, temperature=t, max_tokens=max_tokens,
                                     budget=Budget(0.0, 24, 4))
        log(f"T={t}: {len(q)} edge records, acceptance {float(y.double().mean()):.3f}")
        qs.append(q)
        ys.append(y)
        ranks.append(rank)
    q, y, rank = torch.cat(qs), torch.cat(ys), torch.cat(ranks)
    plain = calibrate(q, y)            # (a, b) alone: the paper's map
    ranked = calibrate(q, y, rank)     # with sibling-rank offsets
    for name, r in (("(a, b) alone", plain), ("with sibling offsets", ranked)):
        c = r.calibration
        log(f"{name:>20}: a={c.a:.3f} b={c.b:.3f} c={[round(x, 3) for x in c.sibling_bias]}  ECE {r.ece_before:.4f} -> "
            f"{r.ece_after:.4f}  Brier {r.brier_before:.4f} -> {r.brier_after:.4f}  log-loss "
            f"{r.log_loss_before:.4f} -> {r.log_loss_after:.4f}")
    report, other = (ranked, plain) if sibling_offsets else (plain, ranked)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.calibration.save(out_dir / "calibration.json", n=report.n,
                            ece_before=round(report.ece_before, 4), ece_after=round(report.ece_after, 4),
                            brier_before=round(report.brier_before, 4), brier_after=round(report.brier_after, 4),
                            log_loss_before=round(report.log_loss_before, 4),
                            log_loss_after=round(report.log_loss_after, 4), variant=_summary(other))
    try:
        reliability_png(q, y, rank, report, out_dir / "reliability.png")
    except ImportError:
        log("matplotlib is not installed: no reliability diagram (pip install '.[loadtest]')")
    log(f"wrote {out_dir / 'calibration.json'} ({'with' if sibling_offsets else 'without'} sibling offsets)")
    return report

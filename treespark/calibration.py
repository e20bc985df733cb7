"""Calibration of edge acceptance: p_hat(edge) = sigmoid(a * logit(q) + b).

The drafter's probability q of a child token is a ranking signal, not a probability
of acceptance. TreeSpark fits two scalars (a, b) by logistic regression on records
(q, accepted) of edges whose ancestors were accepted, so that the product of p_hat
along a root-to-node path estimates P(node accepted): the *path survival* that
drives expansion, stopping and the serving budget. Reported with ECE and Brier.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_EPS = 1e-6


def logit(q: torch.Tensor) -> torch.Tensor:
    q = q.clamp(_EPS, 1 - _EPS)
    return torch.log(q) - torch.log1p(-q)


@dataclass(frozen=True)
class Calibration:
    """Two scalars mapping drafter probability to acceptance probability."""

    a: float = 1.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise ValueError(f"calibration (a, b) must be finite, got ({self.a}, {self.b})")

    def p_hat(self, q: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.a * logit(q.to(torch.float32)) + self.b)

    def p_hat_scalar(self, q: float) -> float:
        q = min(max(q, _EPS), 1 - _EPS)
        z = self.a * (math.log(q) - math.log1p(-q)) + self.b
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def save(self, path: str | Path, **report: float) -> None:
        Path(path).write_text(json.dumps({**asdict(self), **report}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        return cls(a=float(data["a"]), b=float(data["b"]))


@dataclass(frozen=True)
class CalibrationReport:
    calibration: Calibration
    n: int
    ece_before: float      # of the identity map p_hat = q
    ece_after: float
    brier_before: float
    brier_after: float


def fit_calibration(
    q: torch.Tensor, accepted: torch.Tensor, *, iters: int = 100, l2: float = 1e-4
) -> Calibration:
    """Logistic regression of ``accepted`` on logit(q) by Newton's method.

    q: [N] drafter probabilities of edges whose ancestors were accepted; accepted: [N] bool.
    """
    if q.numel() != accepted.numel():
        raise ValueError("q and accepted must have the same length")
    if q.numel() == 0:
        raise ValueError("cannot fit a calibration on zero records")
    x = logit(q.to(torch.float64).flatten())
    y = accepted.to(torch.float64).flatten()
    X = torch.stack([x, torch.ones_like(x)], dim=1)  # [N, 2]
    w = torch.tensor([1.0, 0.0], dtype=torch.float64)
    reg = torch.diag(torch.tensor([l2, l2], dtype=torch.float64)) * len(y)
    for _ in range(iters):
        p = torch.sigmoid(X @ w)
        grad = X.T @ (p - y) + reg @ w
        hess = (X * (p * (1 - p)).unsqueeze(1)).T @ X + reg
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if step.abs().max() < 1e-10:
            break
    return Calibration(a=float(w[0]), b=float(w[1]))


def expected_calibration_error(p: torch.Tensor, y: torch.Tensor, bins: int = 15) -> float:
    """ECE with equal-width bins: sum_b |B_b|/N * |mean(y) - mean(p)| over bin b."""
    p = p.to(torch.float64).flatten()
    y = y.to(torch.float64).flatten()
    idx = (p * bins).long().clamp(max=bins - 1)
    ece = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            ece += float(m.sum()) / len(p) * abs(float(y[m].mean() - p[m].mean()))
    return ece


def brier_score(p: torch.Tensor, y: torch.Tensor) -> float:
    return float(((p.to(torch.float64) - y.to(torch.float64)) ** 2).mean())


def calibrate(q: torch.Tensor, accepted: torch.Tensor) -> CalibrationReport:
    """Fit (a, b) and report ECE / Brier before (p_hat = q) and after."""
    cal = fit_calibration(q, accepted)
    after = cal.p_hat(q)
    return CalibrationReport(
        calibration=cal,
        n=int(q.numel()),
        ece_before=expected_calibration_error(q, accepted),
        ece_after=expected_calibration_error(after, accepted),
        brier_before=brier_score(q, accepted),
        brier_after=brier_score(after, accepted),
    )

"""Layer e: the calibration fit recovers known (a, b); ECE and Brier improve."""

from __future__ import annotations

import json

import pytest
import torch

from treespark.calibration import (
    Calibration,
    calibrate,
    expected_calibration_error,
    fit_calibration,
    logit,
)


def synthetic(a: float, b: float, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01
    p = torch.sigmoid(a * logit(q) + b)
    return q, torch.rand(n, generator=g, dtype=torch.float64) < p


@pytest.mark.parametrize("a,b", [(1.0, 0.0), (1.7, -0.6), (0.5, 1.2)])
def test_fit_recovers_known_parameters(a, b):
    q, y = synthetic(a, b, 40_000, seed=1)
    cal = fit_calibration(q, y)
    assert abs(cal.a - a) < 0.06 and abs(cal.b - b) < 0.06


def test_report_shows_improvement_and_round_trips(tmp_path):
    q, y = synthetic(2.0, -1.0, 20_000, seed=2)
    report = calibrate(q, y)
    assert report.ece_after < 0.02 < report.ece_before
    assert report.brier_after < report.brier_before
    path = tmp_path / "calibration.json"
    report.calibration.save(path, ece=report.ece_after)
    assert Calibration.load(path) == report.calibration
    assert json.loads(path.read_text())["ece"] == report.ece_after


def test_ece_of_a_perfect_predictor_is_small():
    q, y = synthetic(1.0, 0.0, 50_000, seed=3)
    assert expected_calibration_error(q, y) < 0.01


def test_bad_inputs():
    with pytest.raises(ValueError):
        fit_calibration(torch.tensor([]), torch.tensor([]))
    with pytest.raises(ValueError):
        fit_calibration(torch.tensor([0.5]), torch.tensor([True, False]))
    with pytest.raises(ValueError):
        Calibration(a=float("nan"), b=0.0)

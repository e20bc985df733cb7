"""Layer e: the calibration fit recovers known (a, b); ECE and Brier improve."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from treespark.spec.calibration import (
    Calibration,
    calibrate,
    expected_calibration_error,
    fit_calibration,
    logit,
    p_hat_of,
    sigmoid,
)


def synthetic(a: float, b: float, n: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.random(n) * 0.98 + 0.01
    return q, rng.random(n) < sigmoid(a * logit(q) + b)


@pytest.mark.parametrize("a,b", [(1.0, 0.0), (1.7, -0.6), (0.5, 1.2)])
def test_fit_recovers_known_parameters(a, b):
    q, y = synthetic(a, b, 40_000, seed=1)
    cal = fit_calibration(q, y)
    assert abs(cal.a - a) < 0.06 and abs(cal.b - b) < 0.06


def test_fit_converges_when_acceptance_depends_weakly_on_q():
    """A full Newton step from the identity start overshot to a = 2e4 on data like the
    default pair's T = 1 records: many tiny q, acceptance barely rising with q."""
    rng = np.random.default_rng(3)
    q = rng.random(4000) ** 3 * 0.98 + 1e-5
    y = rng.random(4000) < sigmoid(0.2 * logit(q) - 1.0)
    cal = fit_calibration(q, y)
    assert abs(cal.a - 0.2) < 0.05 and abs(cal.b + 1.0) < 0.1


def test_report_shows_improvement_and_round_trips(tmp_path):
    q, y = synthetic(2.0, -1.0, 20_000, seed=2)
    report = calibrate(q, y)
    assert report.ece_after < 0.02 < report.ece_before
    assert report.brier_after < report.brier_before
    path = tmp_path / "calibration.json"
    report.calibration.save(path, ece=report.ece_after)
    assert Calibration.load(path) == report.calibration
    assert json.loads(path.read_text())["ece"] == report.ece_after


def test_fit_recovers_sibling_offsets_and_beats_the_two_scalar_map(tmp_path):
    rng = np.random.default_rng(4)
    n = 60_000
    q = rng.random(n) * 0.98 + 0.01
    rank = rng.integers(0, 5, n)
    truth = Calibration(1.4, -0.5, sibling_bias=(-0.8, -1.5, -2.0))
    y = rng.random(n) < p_hat_of(truth, q, rank)
    report = calibrate(q, y, rank)
    cal = report.calibration
    assert abs(cal.a - 1.4) < 0.06 and abs(cal.b + 0.5) < 0.06
    # ranks 3 and 4 share the last offset (-2.0 both in the truth)
    assert [round(c, 1) for c in cal.sibling_bias] == pytest.approx([-0.8, -1.5, -2.0], abs=0.11)
    assert cal.offset(0) == 0.0 and cal.offset(9) == cal.sibling_bias[-1]
    two = calibrate(q, y)
    assert two.calibration.sibling_bias == ()
    assert report.log_loss_after < two.log_loss_after - 0.01
    path = tmp_path / "c.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    path.write_text(json.dumps({"a": 0.5, "b": -1.0}))   # a file from before sibling offsets
    assert Calibration.load(path) == Calibration(0.5, -1.0)
    assert cal.with_ab(2.0, 1.0) == Calibration(2.0, 1.0, cal.sibling_bias)


def test_sampled_map_round_trips_and_survives_an_online_refit(tmp_path):
    sampled = Calibration(0.3, -1.1, sibling_bias=(-1.0,))
    cal = Calibration(0.8, -0.3, sampled=sampled)
    assert cal.at(0.0) is cal and cal.at(0.7) is sampled and cal.at(1.0) is sampled
    assert Calibration(0.8, -0.3).at(1.0) == Calibration(0.8, -0.3)
    cal.save(tmp_path / "c.json", n=10)
    assert Calibration.load(tmp_path / "c.json") == cal
    refit = cal.with_ab(1.0, 0.0)
    assert refit.sampled == sampled and (refit.a, refit.b) == (1.0, 0.0)
    with pytest.raises(ValueError, match="sampled map"):
        Calibration(1.0, 0.0, sampled=cal)


def test_ece_of_a_perfect_predictor_is_small():
    q, y = synthetic(1.0, 0.0, 50_000, seed=3)
    assert expected_calibration_error(q, y) < 0.01


def test_ece_by_hand():
    # bins of width 0.5: {0.1, 0.2} -> |0.5 - 0.15|, {0.9} -> |0 - 0.9|
    assert expected_calibration_error([0.1, 0.2, 0.9], [True, False, False], bins=2) == pytest.approx(
        (2 * 0.35 + 0.9) / 3)
    assert np.isnan(expected_calibration_error([], []))


def test_fit_takes_torch_tensors_and_p_hat_maps_them():
    """The engine's records arrive as tensors; the expansion maps a tensor of q."""
    q, y = synthetic(1.5, -0.5, 5000, seed=5)
    assert fit_calibration(torch.from_numpy(q), torch.from_numpy(y)) == fit_calibration(q, y)
    cal = Calibration(1.5, -0.5, sibling_bias=(-1.0,))
    t = torch.tensor([0.05, 0.5, 0.95])
    for rank in (0, 1):
        got = cal.p_hat(t, rank)
        assert got.dtype == torch.float32
        assert got.tolist() == pytest.approx([cal.p_hat_scalar(float(x), rank) for x in t], rel=1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError):
        fit_calibration([], [])
    with pytest.raises(ValueError):
        fit_calibration([0.5], [True, False])
    with pytest.raises(ValueError):
        Calibration(a=float("nan"), b=0.0)
    with pytest.raises(ValueError):
        Calibration(a=1.0, b=0.0, sibling_bias=(float("inf"),))
    with pytest.raises(ValueError):
        fit_calibration([0.5, 0.4], [True, False], [0])


def test_calibrate_pair_stores_the_map_in_use_and_its_variant(tmp_path):
    """`treespark calibrate` on a tiny random pair: both fits land in calibration.json,
    the ones in use on top and the others under ``variant``. By default only the sampled
    map carries sibling offsets; "none" and "all" put them nowhere or in both maps."""
    from treespark import random_pair
    from treespark.spec.calibration import load_variant
    from treespark.training.calibrate import calibrate_pair

    pair = random_pair(64, 0, block_size=3)
    quiet = dict(n_prompts=3, max_tokens=12, log=lambda *a: None)
    returned = calibrate_pair(pair, tmp_path / "default", **quiet)
    used, other = (Calibration.load(tmp_path / "default" / "calibration.json"),
                   load_variant(tmp_path / "default" / "calibration.json"))
    assert used == returned
    assert used.sibling_bias == () and len(used.sampled.sibling_bias) == 3
    # each regime has its own fit: the sampled map comes from T = 1 records
    assert (used.sampled.a, used.sampled.b) != (used.a, used.b)
    # the variant beside offsets in use is the two-scalar pair of maps
    assert other.sibling_bias == () and other.sampled.sibling_bias == ()
    assert (other.a, other.b) == (used.a, used.b) and other.sampled != used.sampled
    none = calibrate_pair(pair, tmp_path / "none", sibling_offsets="none", **quiet)
    assert none == other, "the same records, the same fits"
    ranked = load_variant(tmp_path / "none" / "calibration.json")
    assert len(ranked.sibling_bias) == 3 and ranked.sampled == used.sampled
    everywhere = calibrate_pair(pair, tmp_path / "all", sibling_offsets="all", **quiet)
    path = tmp_path / "all" / "calibration.json"
    assert everywhere == ranked == Calibration.load(path) and load_variant(path) == none
    stored = json.loads(path.read_text())
    assert stored["n"] > 0 and stored["sampled"]["n"] > 0 and stored["sampled"]["temperature"] == 1.0
    assert (tmp_path / "all" / "reliability.png").stat().st_size > 0
    with pytest.raises(ValueError, match="sibling_offsets"):
        calibrate_pair(pair, tmp_path / "bad", sibling_offsets="some", **quiet)
    assert not (tmp_path / "bad").exists(), "a bad choice fails before any decoding or writing"
    # drafts at T > 0 are drawn at q's own temperature unless told otherwise, and the
    # sampled maps keep the scale their records were drafted at
    assert used.sampled.temperature_scale == other.sampled.temperature_scale == 1.0
    fixed = calibrate_pair(pair, tmp_path / "fixed", temperature_scale=0.3, **quiet)
    assert fixed.sampled.temperature_scale == 0.3
    assert (fixed.sampled.a, fixed.sampled.b) != (used.sampled.a, used.sampled.b), "fitted on drafts at 0.3 T"
    assert (fixed.a, fixed.b) == (used.a, used.b), "T = 0 drafts are ranked, not drawn: no scale"
    assert json.loads((tmp_path / "fixed" / "calibration.json").read_text())["sampled"]["temperature_scale"] == 0.3
    assert fixed.draft_temperature(0.5) == pytest.approx(0.15) and fixed.draft_temperature(0.0) == 0.0
    with pytest.raises(ValueError, match="temperature_scale"):
        calibrate_pair(pair, tmp_path / "bad", temperature_scale=0.0, **quiet)
    assert load_variant(tmp_path / "missing.json") is None


def test_calibration_for_a_drafter(tmp_path):
    """Its own calibration.json first; else the published fit for the public DSpark
    Qwen3-4B drafter (the reference code's a, b); else the identity map."""
    from treespark.spec.calibration import Calibration, calibration_for

    public = "deepseek-ai/dspark_qwen3_4b_block7"
    assert calibration_for(tmp_path, public) == Calibration(a=0.6684, b=-0.4587)
    assert calibration_for(tmp_path, "someone/else") == Calibration()
    Calibration(a=0.9, b=-0.2).save(tmp_path / "calibration.json")
    assert calibration_for(tmp_path, public) == Calibration(a=0.9, b=-0.2)


def test_temperature_scale_round_trips_and_survives_a_refit(tmp_path):
    """The sampled map's drafting scale is stored, read back (1 where a file has
    none), kept by an online (a, b) refit, and must be a positive number."""
    cal = Calibration(1.0, 0.0, sampled=Calibration(0.3, -1.0, temperature_scale=0.6))
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal
    assert Calibration.from_dict({"a": 1.0, "b": 0.0}).temperature_scale == 1.0
    assert cal.draft_temperature(1.0) == pytest.approx(0.6) and cal.draft_temperature(0.0) == 0.0
    assert cal.with_ab(0.9, 0.1).sampled.temperature_scale == 0.6
    assert Calibration(temperature_scale=0.5).draft_temperature(2.0) == 1.0  # one map at every T
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature_scale"):
            Calibration(temperature_scale=bad)

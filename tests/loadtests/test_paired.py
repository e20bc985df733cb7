"""Paired A/B comparisons: block order, paired ratios, bootstrap intervals, the report."""

import numpy as np
import pytest

from loadtests.paired import block_latency, plan
from loadtests.paired_report import (
    BLOCK_FIELDS,
    Block,
    policy_ratios,
    ratios_of,
    read_blocks,
    report,
    write_blocks,
)
from loadtests.pairstats import (
    A,
    B,
    abba_sides,
    bootstrap_geomean_of_medians,
    bootstrap_median,
    geomean,
    paired_ratios,
)


def _drifting_blocks(ratio: float, pairs: int, rng: np.random.Generator, cv: float = 0.05,
                     drift: float = 0.3) -> tuple[list[str], list[float]]:
    """Goodputs of ABBA blocks on a machine whose speed drifts by ``drift`` over the run,
    with per-block noise ``cv``; A is ``ratio`` times B."""
    sides = abba_sides(pairs)
    speed = 50.0 * (1 + drift * np.linspace(0, 1, len(sides)))              # [blocks]
    noise = np.exp(cv * rng.standard_normal(len(sides)))                     # [blocks]
    return sides, [float(s * n * (ratio if side == A else 1.0)) for s, n, side in zip(speed, noise, sides, strict=True)]


def test_blocks_alternate_abba_and_every_pair_has_both_sides():
    assert abba_sides(3) == ["A", "B", "B", "A", "A", "B"]
    assert "".join(abba_sides(4)) == "ABBAABBA"
    with pytest.raises(AssertionError):
        paired_ratios(["A", "A"], [1.0, 2.0])


def test_paired_ratios_divide_a_by_b_whatever_the_order():
    assert paired_ratios(abba_sides(2), [10.0, 5.0, 4.0, 12.0]).tolist() == [2.0, 3.0]


def test_a_known_ratio_is_recovered_through_drift():
    rng = np.random.default_rng(1)
    sides, g = _drifting_blocks(1.10, pairs=6, rng=rng)
    iv = bootstrap_median(paired_ratios(sides, g), np.random.default_rng(0))
    assert iv.contains(1.10) and not iv.contains(1.0) and iv.verdict() == "A faster"
    # independent medians (no pairing) of the same blocks are moved by the drift's order
    a = np.median([x for x, s in zip(g, sides, strict=True) if s == A])
    b = np.median([x for x, s in zip(g, sides, strict=True) if s == B])
    assert abs(a / b - 1.10) > abs(iv.point - 1.10)


def test_an_aa_interval_contains_one():
    hits = 0
    for seed in range(40):
        sides, g = _drifting_blocks(1.0, pairs=5, rng=np.random.default_rng(100 + seed))
        iv = bootstrap_median(paired_ratios(sides, g), np.random.default_rng(seed))
        hits += iv.contains(1.0)
        assert iv.lo <= iv.point <= iv.hi
    assert hits >= 34      # a 95 % interval of 5 pairs' median; coverage is coarse at n = 5


def test_the_bootstrap_is_seeded_and_narrows_with_more_pairs():
    r = np.exp(0.05 * np.random.default_rng(3).standard_normal(40)) * 0.9
    one = bootstrap_median(r[:5], np.random.default_rng(7))
    assert one == bootstrap_median(r[:5], np.random.default_rng(7))
    many = bootstrap_median(r, np.random.default_rng(7))
    assert many.hi - many.lo < one.hi - one.lo and many.contains(0.9)


def test_the_geometric_mean_over_levels_and_its_stratified_interval():
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    levels = [np.exp(0.03 * rng.standard_normal(5)) * r for r in (0.9, 1.0, 1.2)]
    iv = bootstrap_geomean_of_medians(levels, np.random.default_rng(0))
    assert iv.point == pytest.approx(geomean([float(np.median(x)) for x in levels]))
    assert iv.contains(geomean([0.9, 1.0, 1.2])) and iv.lo < iv.point < iv.hi


def _blocks(experiment, users, pairs, a, b, ratio, fixed="chain2"):
    sides, g = _drifting_blocks(ratio, pairs, np.random.default_rng(users))
    return [Block(experiment, users, i // 2, s, a if s == A else (fixed if b is None else b), float(i), 15.0,
                  15.0 * x, x, 1.0, float(users), 0.0) for i, (s, x) in enumerate(zip(sides, g, strict=True))]


def test_report_reads_blocks_csv_and_gives_every_table(tmp_path):
    blocks = _blocks("aa", 8, 5, "perstep", "perstep", 1.0) + _blocks("paired", 8, 5, "perstep", "off", 1.3) \
        + _blocks("paired", 1, 5, "perstep", "tree8", 0.8) \
        + [Block("screen", 8, 0, s, p, 0.0, 10.0, 10.0 * x, x, 0.0, 8.0, 0.0)
           for s, p, x in (("A", "perstep", 50.0), ("B", "chain", 40.0), ("B", "off", 45.0), ("A", "perstep", 45.0))]
    for i in (1, 2):
        blocks[-i].pair = 1
    write_blocks(tmp_path / "blocks.csv", blocks)
    back = read_blocks(tmp_path / "blocks.csv")
    assert [b.policy for b in back] == [b.policy for b in blocks] and back[0].users == 8 and back[0].pair == 0
    text = report(back)
    assert "| 8 | off | 5 |" in text and "per-step faster" in text
    assert "| 1 | tree8 | 5 |" in text and "per-step slower" in text
    assert "A/A" in text and "no difference resolved" in text
    # every fixed policy: the screen's pairs (chain 50 / 40, off 45 / 45) pooled with the
    # paired pass's where the policy was the level's best (off at 8, tree8 at 1)
    by = policy_ratios(back)
    assert list(by) == ["chain", "off", "tree8"] and list(by["tree8"]) == [1]
    assert by["chain"][8].tolist() == [1.25]
    assert by["off"][8][0] == 1.0 and len(by["off"][8]) == 6
    np.testing.assert_allclose(by["off"][8][1:], ratios_of(back, "paired", 8))
    off8 = float(np.median(by["off"][8]))
    assert f"| 8 | 1.25 (1) | {off8:.2f} (6) |  |" in text
    assert f"| 1 |  |  | {np.median(by['tree8'][1]):.2f} (5) |" in text
    assert "at least" in text and "(against tree8; per-step slower)" in text


def test_the_aa_users_level_runs_first_with_its_three_experiments():
    class Args:
        experiments, levels, aa_users, cluster_users = ["aa", "ramp", "default-off"], [1, 2, 4, 8, 16], 8, [8, 16]
    assert plan(Args) == [(8, ["aa", "ramp", "default-off"]), (1, ["ramp"]), (2, ["ramp"]), (4, ["ramp"]),
                          (16, ["ramp"])]
    Args.experiments = ["ramp"]
    assert [u for u, _ in plan(Args)] == [8, 1, 2, 4, 16]


def test_cluster_local_runs_at_its_own_levels_sharing_a_level_already_planned():
    class Args:
        experiments, levels, aa_users, cluster_users = ["cluster-local"], [1, 2, 4, 8, 16], 8, [8, 16]
    assert plan(Args) == [(8, ["cluster-local"]), (16, ["cluster-local"])]
    Args.experiments, Args.cluster_users = ["aa", "ramp", "cluster-local"], [24, 16]
    assert plan(Args) == [(8, ["aa", "ramp"]), (1, ["ramp"]), (2, ["ramp"]), (4, ["ramp"]),
                          (16, ["ramp", "cluster-local"]), (24, ["cluster-local"])]


def test_a_blocks_latency_is_that_of_the_requests_that_ended_in_it():
    records = [{"t0": 0.0, "t1": 9.0, "ttft": 1.0, "ok": True},     # ended before the block
               {"t0": 5.0, "t1": 11.0, "ttft": 2.0, "ok": True}] \
        + [{"t0": 10.0 + i, "t1": 12.0 + 2 * i, "ttft": 0.5, "ok": True} for i in range(10)] \
        + [{"t0": 10.0, "t1": 13.0, "ttft": None, "ok": False},    # failed: not counted
           {"t0": 18.0, "t1": 25.0, "ttft": 0.1, "ok": True}]      # ended after it
    n, e2e, ttft = block_latency(records, 10.0, 20.0)
    e2es = [6.0, 2.0, 3.0, 4.0, 5.0]                                # ended at 11, 12, 14, 16 and 18
    assert n == 5 and e2e == pytest.approx(np.percentile(e2es, 90))
    assert ttft == pytest.approx(np.percentile([2.0] + [0.5] * 4, 90))
    assert block_latency(records, 100.0, 110.0)[0] == 0 and np.isnan(block_latency(records, 100.0, 110.0)[1])


def test_the_cluster_local_table_reads_goodput_and_latency_per_level(tmp_path):
    blocks = _blocks("cluster-local", 8, 5, "perstep", "perstep-local", 1.0) \
        + _blocks("cluster-local", 16, 5, "perstep", "perstep-local", 1.3)
    for i, b in enumerate(blocks):   # latency: the cluster's price halves it at 16 users, changes nothing at 8
        b.theta, b.queued_max, b.requests, b.t0 = (0.5 if b.side == A else 0.3), 4.0, 12, 1.7964e9 + 18.123 * i
        b.e2e_p90_s = 10.0 * (0.5 if b.users == 16 and b.side == A else 1.0) * (1 + 0.01 * b.pair)
    write_blocks(tmp_path / "blocks.csv", blocks)
    back = read_blocks(tmp_path / "blocks.csv")
    assert [b.t0 for b in back] == pytest.approx([b.t0 for b in blocks], abs=1e-3)   # unix times to the ms
    text = report(back)
    assert "the cluster's price (A) against each replica's own (B)" in text
    rows = {int(line.split("|")[1]): line for line in text.splitlines() if line.startswith("| 8 |") or line.startswith("| 16 |")}
    assert "| 0.50 / 0.30 |" in rows[8] and "no difference resolved" in rows[8]
    assert "cluster faster" in rows[16] and "cluster shorter" in rows[16] and "| 0.500 [0.500, 0.500] |" in rows[16]
    assert "| 1.000 [1.000, 1.000] | no difference resolved |" in rows[8]


def test_an_older_blocks_csv_without_the_latency_columns_still_reads(tmp_path):
    old = [f for f in BLOCK_FIELDS if f not in ("queued_max", "theta", "requests", "e2e_p90_s", "ttft_p90_s")]
    (tmp_path / "blocks.csv").write_text(",".join(old) + "\naa,8,0,A,perstep,1.0,15,150,10,0.5,8,0\n")
    (b,) = read_blocks(tmp_path / "blocks.csv")
    assert b.goodput_tok_s == 10.0 and b.requests == 0 and np.isnan(b.e2e_p90_s)

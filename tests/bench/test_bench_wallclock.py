"""treespark bench wallclock / theta on a tiny random pair: the table's rows and columns."""

import itertools
from types import SimpleNamespace

import torch

from treespark import random_pair
from treespark.bench import device_timing
from treespark.bench.wallclock import goal_lines, theta_sweep, wallclock_benchmark


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:] if line.startswith("|")]


def test_wallclock_table_has_every_decoder_and_the_round_breakdown_at_each_temperature():
    pair = random_pair(64, 0, block_size=4)
    table = wallclock_benchmark(pair, n_prompts=2, max_tokens=6, chains=(1, 2), temperatures=(0.0, 1.0),
                                profile_s=1.0, bandwidth_bytes=1 << 16, log=lambda *_: None)
    header = table.splitlines()[0]
    assert "draft ms / step" in header and "tokens / round" in header and "host share" in header
    for temp, hf in (("0", {"HF generate greedy", "HF prompt lookup"}), ("1", {"HF generate sampling"})):
        rows = {r[1]: r[1:] for r in _rows(table) if r[0] == temp}
        chain = [name for name in rows if name.startswith("tuned chain (k=")]
        assert chain in (["tuned chain (k=1)"], ["tuned chain (k=2)"])  # the faster of the two
        assert set(rows) - set(chain) == {"adaptive tree", "per-step (served default)", "our plain decoding"} | hf
        assert rows["adaptive tree"][2] == "1.00x"
        plain = rows["our plain decoding"]
        assert plain[3] == "0.0" and plain[6] == "1.00"  # no tree: one token per round
        assert float(rows["adaptive tree"][5]) > 0
        for k in ("adaptive tree", "per-step (served default)", "our plain decoding"):
            share, profiler = rows[k][8].split(" (<= ")
            assert float(rows[k][7]) > 10 and 0.0 <= float(profiler.rstrip(")")) <= float(share) <= 1.0
        assert all(rows[k][3:] == ["-"] * 6 for k in hf)
    notes = table.split("\n\n")[1:]
    assert notes[0] == "llama.cpp rows skipped: this pair has no GGUF."
    assert notes[1].startswith("Host share: the profiler's own cost, measured in this run, is ")
    limit = notes[-1]
    assert limit.startswith("T = 0, fp32 bandwidth limit: ") and "our plain decoding" in limit
    plain = next(r[2] for r in _rows(table) if r[:2] == ["0", "our plain decoding"])
    assert f"our plain decoding {plain} tok/s" in limit


def test_goal_lines_give_the_served_default_over_llamacpp_and_plain_over_the_bandwidth_limit():
    results = {"per-step (served default)": 30.0, "our plain decoding": 12.0, "llama.cpp greedy": 60.0}
    ratio, limit = goal_lines(results, weight_bytes=500_000_000, bytes_per_s=10e9)  # limit: 20 tok/s
    assert "30.00 / 60.00 tok/s = 0.50 (goal >= 0.67" in ratio
    assert "= 20.00 tok/s; our plain decoding 12.00 tok/s = 0.60 of it" in limit
    del results["llama.cpp greedy"]
    assert goal_lines(results, weight_bytes=500_000_000, bytes_per_s=10e9) == [limit]


def test_theta_sweep_rows():
    pair = random_pair(64, 0, block_size=4)
    rows = _rows(theta_sweep(pair, thetas=(0.1,), chains=(2,), n_prompts=1, max_tokens=5, log=lambda *_: None))
    assert [r[0] for r in rows] == ["plain", "adaptive theta=0.1", "chain k=2"]
    assert rows[0][2] == "0.0" and 0 < float(rows[2][2]) <= 2.0


def test_read_bandwidth_counts_each_byte_read_once(monkeypatch):
    """The limit's bandwidth is bytes read over time, each byte once (a copy reads and
    writes each); here every timed sum takes 0.25 s of an injected clock."""
    ticks = itertools.count(step=0.25)  # each clock read 0.25 s after the last
    monkeypatch.setattr(device_timing, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert device_timing.read_bandwidth(torch.device("cpu"), 4096, reps=3) == 4096 / 0.25

"""The paired runner's record and report: ``Block`` (a row of ``blocks.csv``), reading and
writing ``blocks.csv``, and the markdown tables of ``paired.md`` built from it (the
statistics are ``loadtests.pairstats``'; the runner is ``loadtests.paired``)."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from loadtests.pairstats import (
    A,
    B,
    Interval,
    bootstrap_geomean_of_medians,
    bootstrap_median,
    paired_ratios,
)

NAN = float("nan")


@dataclass
class Block:
    """One measured block (a row of ``blocks.csv``)."""

    experiment: str         # aa | screen | paired | default-off | cluster-local
    users: int
    pair: int               # pairs counted from 0 within (experiment, users)
    side: str               # A | B
    policy: str             # perstep, perstep-local or a BASELINES name
    t0: float               # unix time the block's measurement began
    seconds: float
    tokens: float
    goodput_tok_s: float
    tree_size: float        # means over the block's status polls (one a second)
    batch_size: float
    queued: float
    # (older blocks.csv files lack the columns below: read as nan)
    queued_max: float = NAN     # the most waiting on one replica
    theta: float = NAN          # the applied theta, replicas weighted by batch
    requests: int = 0           # requests that ended in the block
    e2e_p90_s: float = NAN      # their end-to-end seconds, 90th percentile
    ttft_p90_s: float = NAN     # their time to first token, 90th percentile


BLOCK_FIELDS = [f.name for f in fields(Block)]


def write_blocks(path: Path, blocks: list[Block]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=BLOCK_FIELDS)
        w.writeheader()
        for b in blocks:
            w.writerow({k: (f"{v:.3f}" if k == "t0" else f"{v:.6g}" if isinstance(v, float) else v)
                        for k, v in asdict(b).items()})


def read_blocks(path: Path) -> list[Block]:
    """``blocks.csv`` as written; a column an older file lacks takes its default."""
    if not path.exists():
        return []
    conv = {"int": int, "str": str, "float": float}
    with path.open() as f:
        return [Block(**{fl.name: conv[str(fl.type)](row[fl.name]) for fl in fields(Block) if row.get(fl.name)})
                for row in csv.DictReader(f)]


def ratios_of(blocks: list[Block], experiment: str, users: int, value: str = "goodput_tok_s") -> np.ndarray:
    """A / B of ``value`` per pair (pairs whose value is not a positive number on both sides
    are left out)."""
    bs = [b for b in blocks if b.experiment == experiment and b.users == users]
    bs = bs[:len(bs) // 2 * 2]
    r = paired_ratios([b.side for b in bs], [getattr(b, value) for b in bs])   # [pairs]
    return r[np.isfinite(r) & (r > 0)]


def _ci(iv: Interval) -> str:
    return f"{iv.point:.3f} [{iv.lo:.3f}, {iv.hi:.3f}]"


def _median_of(blocks: list[Block], experiment: str, users: int, side: str, value: str = "goodput_tok_s") -> float:
    xs = [getattr(b, value) for b in blocks if b.experiment == experiment and b.users == users and b.side == side]
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.median(xs)) if xs else NAN


def latency_verdict(iv: Interval, a: str, b: str) -> str:
    """What an interval of latency ratios a / b says (above 1: a's latency is longer)."""
    if iv.lo > 1.0:
        return f"{a} longer"
    if iv.hi < 1.0:
        return f"{a} shorter"
    return "no difference resolved"


def cluster_local_table(blocks: list[Block], rng: np.random.Generator, draws: int) -> list[str]:
    """The ``cluster-local`` experiment's table: goodput and p90 latency, the cluster's price
    against each replica's own, per level."""
    ex = "cluster-local"
    levels = sorted({b.users for b in blocks if b.experiment == ex})
    if not levels:
        return []
    lines = ["**Per-step: the cluster's price (A) against each replica's own (B)**", "",
             "| users | pairs | A tok/s | B tok/s | theta A / B | queued A / B (most on one replica) | "
             "goodput A / B, median [95 % CI] | reads | p90 e2e s A / B | p90 e2e A / B, median [95 % CI] | reads |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for u in levels:
        r = ratios_of(blocks, ex, u)
        if not len(r):
            continue
        iv = bootstrap_median(r, rng, draws)
        lat = ratios_of(blocks, ex, u, "e2e_p90_s")
        lat_cells = "| |"
        if len(lat):
            lat_iv = bootstrap_median(lat, rng, draws)
            lat_cells = f"{_ci(lat_iv)} | {latency_verdict(lat_iv, 'cluster', 'local')} |"
        lines.append(f"| {u} | {len(r)} | {_median_of(blocks, ex, u, A):.1f} | {_median_of(blocks, ex, u, B):.1f} | "
                     f"{_sides(blocks, ex, u, 'theta', '.2f')} | {_sides(blocks, ex, u, 'queued', '.1f')} "
                     f"({_sides(blocks, ex, u, 'queued_max', '.1f')}) | {_ci(iv)} | {iv.verdict('cluster', 'local')} | "
                     f"{_sides(blocks, ex, u, 'e2e_p90_s', '.2f')} | " + lat_cells)
    return lines + [""]


def _sides(blocks: list[Block], experiment: str, users: int, value: str, fmt: str) -> str:
    """``value``'s median over the A blocks and over the B blocks: "a / b"."""
    return " / ".join(format(_median_of(blocks, experiment, users, s, value), fmt) for s in (A, B))


def policy_ratios(blocks: list[Block]) -> dict[str, dict[int, np.ndarray]]:
    """Per-step / fixed policy p at each level, every pair that measured the two side by
    side: the screen's pairs of p, and the paired pass's where p was the level's best."""
    out: dict[str, dict[int, list[float]]] = {}
    screen = [b for b in blocks if b.experiment == "screen"]
    for u in sorted({b.users for b in screen}):
        for i in sorted({b.pair for b in screen if b.users == u}):
            got = {b.side: b for b in screen if b.users == u and b.pair == i}
            if set(got) == {A, B} and got[B].goodput_tok_s > 0 and got[A].goodput_tok_s > 0:
                out.setdefault(got[B].policy, {}).setdefault(u, []).append(
                    got[A].goodput_tok_s / got[B].goodput_tok_s)
    for u in sorted({b.users for b in blocks if b.experiment == "paired"}):
        fixed = next(b.policy for b in blocks if b.experiment == "paired" and b.users == u and b.side == B)
        out.setdefault(fixed, {}).setdefault(u, []).extend(ratios_of(blocks, "paired", u).tolist())
    return {p: {u: np.asarray(r) for u, r in sorted(by.items()) if r} for p, by in out.items()}


def every_policy_table(blocks: list[Block], rng: np.random.Generator, draws: int) -> list[str]:
    """Per-step against each fixed policy at each level (the median of every pair measured
    side by side, their count in brackets) and over the levels (the geometric mean of the
    level medians, stratified bootstrap interval)."""
    by_policy = policy_ratios(blocks)
    if not by_policy:
        return []
    levels = sorted({u for by in by_policy.values() for u in by})
    pols = list(by_policy)
    lines = ["**Per-step against every fixed policy** (median of the pairs measured at a level: the "
             "screen's, and the paired pass's for the level's best; pairs in brackets)", "",
             "| users | " + " | ".join(pols) + " |", "|---" * (len(pols) + 1) + "|"]
    for u in levels:
        lines.append(f"| {u} | " + " | ".join(
            f"{np.median(by_policy[p][u]):.2f} ({len(by_policy[p][u])})" if u in by_policy[p] else ""
            for p in pols) + " |")
    gms = {p: bootstrap_geomean_of_medians(list(by_policy[p].values()), rng, draws) for p in pols}
    lines.append("| geometric mean [95 % CI] | " + " | ".join(_ci(gms[p]) for p in pols) + " |")
    worst = min(pols, key=lambda p: gms[p].point)
    lines += ["", f"Per-step against every single fixed policy over the levels: at least {gms[worst].point:.3f}x "
              f"(against {worst}; {gms[worst].verdict('per-step', worst)}).", ""]
    return lines


def report(blocks: list[Block], seed: int = 0, draws: int = 10_000) -> str:
    """The markdown tables of ``blocks`` (bootstrap from ``np.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    lines: list[str] = []
    for ex, title, a_name, b_name in (("aa", "A/A: per-step against per-step", "A: per-step", "B: per-step"),
                                      ("default-off", "The served default against off", "per-step", "off")):
        levels = sorted({b.users for b in blocks if b.experiment == ex})
        if not levels:
            continue
        lines += [f"**{title}**", "", f"| users | pairs | {a_name} tok/s | {b_name} tok/s | ratio, median [95 % CI] | "
                  "reads |", "|---|---|---|---|---|---|"]
        for u in levels:
            r = ratios_of(blocks, ex, u)
            if not len(r):
                continue
            iv = bootstrap_median(r, rng, draws)
            lines.append(f"| {u} | {len(r)} | {_median_of(blocks, ex, u, A):.1f} | {_median_of(blocks, ex, u, B):.1f} "
                         f"| {_ci(iv)} | {iv.verdict('A', 'B') if ex == 'aa' else iv.verdict('per-step', 'off')} |")
        lines.append("")
    levels = sorted({b.users for b in blocks if b.experiment == "paired" and b.side == B})
    per_level = {u: ratios_of(blocks, "paired", u) for u in levels}
    per_level = {u: r for u, r in per_level.items() if len(r)}
    if per_level:
        lines += ["**Per-step against the best fixed policy** (picked by the screen at each level)", "",
                  "| users | best fixed | pairs | per-step tok/s | fixed tok/s | tree (per-step) | "
                  "per-step / best fixed, median [95 % CI] | reads |", "|---|---|---|---|---|---|---|---|"]
        for u, r in per_level.items():
            iv = bootstrap_median(r, rng, draws)
            fixed = next(b.policy for b in blocks if b.experiment == "paired" and b.users == u and b.side == B)
            tree = np.mean([b.tree_size for b in blocks if b.experiment == "paired" and b.users == u and b.side == A])
            lines.append(f"| {u} | {fixed} | {len(r)} | {_median_of(blocks, 'paired', u, A):.1f} | "
                         f"{_median_of(blocks, 'paired', u, B):.1f} | {tree:.2f} | {_ci(iv)} | "
                         f"{iv.verdict('per-step', fixed)} |")
        gm = bootstrap_geomean_of_medians(list(per_level.values()), rng, draws)
        lines += [f"| all | | | | | | geometric mean {_ci(gm)} | {gm.verdict('per-step', 'best fixed')} |", ""]
    lines += every_policy_table(blocks, rng, draws)
    lines += cluster_local_table(blocks, rng, draws)
    return "\n".join(lines)


def write_report(out: Path, command: str, seed: int) -> str:
    blocks = read_blocks(out / "blocks.csv")
    text = f"# Paired policy comparison\n\n    {command}\n\n{report(blocks, seed)}"
    (out / "paired.md").write_text(text)
    return text


# -- the command ----------------------------------------------------------------------------------

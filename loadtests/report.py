"""Plots and tables for the load experiments (``loadtests.experiment`` writes the CSVs).

* ``plot_timeline``  users, theta, mean tree size, mean width, accepted tokens per round,
                     goodput and p50/p99 latency over time, one panel each;
* ``ramp_summary``   per load level (going up, then down): the means of those series after
                     the trees settle, and the tree-size ratio lowest/highest load;
* ``plot_compare`` / ``compare_table``  goodput by policy and concurrency, with the
                     adaptive policy's ratio to the best fixed one and to no speculation.

    python -m loadtests.report docs/load/ramp/timeline.csv docs/load/compare/compare.csv
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_rows(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return list(csv.DictReader(f))


def num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def smooth(xs: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - k + 1): i + 1] if not math.isnan(x)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def plot_timeline(csv_path: Path, png_path: Path, title: str = "") -> None:
    rows = read_rows(csv_path)
    t = [num(r["t"]) for r in rows]
    panels = [
        ("users", [("users", "users", 1)]),
        ("theta (price of a node)", [("theta", "theta", 1)]),
        ("mean tree size (nodes)", [("tree_size", "tree size", 1), ("node_cap", "node cap", 1)]),
        ("mean width", [("width", "width", 1)]),
        ("accepted tokens / round", [("accepted_per_round", "accepted/round", 3)]),
        ("goodput (tokens/s)", [("goodput_tok_s", "goodput (3-s)", 3)]),
        ("latency (s, last 10 s)", [("p50_e2e_s", "p50 end-to-end", 1), ("p99_e2e_s", "p99 end-to-end", 1),
                                    ("p50_ttft_s", "p50 TTFT", 1)]),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.0 * len(panels)), sharex=True)
    for ax, (label, series) in zip(axes, panels, strict=True):
        for key, name, k in series:
            ys = smooth([num(r.get(key)) for r in rows], k)
            ax.plot(t, ys, label=name, drawstyle="steps-post" if key in ("users", "node_cap") else "default")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("time (s)")
    fig.suptitle(title or f"TreeSpark Serve under load ({Path(csv_path).name})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _mean(rows: list[dict], key: str) -> float:
    vals = [v for v in (num(r.get(key)) for r in rows) if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def ramp_levels(rows: list[dict], settle_s: float = 8.0) -> list[dict]:
    """Consecutive segments of constant users, with means over the settled part."""
    segs: list[dict] = []
    for r in rows:
        u = int(num(r["users"])) if not math.isnan(num(r["users"])) else 0
        if not segs or segs[-1]["users"] != u:
            segs.append({"users": u, "t0": num(r["t"]), "rows": []})
        segs[-1]["rows"].append(r)
    peak = max((s["users"] for s in segs), default=0)
    seen_peak = False
    out = []
    for s in segs:
        if s["users"] == peak:
            seen_peak = True
        settled = [r for r in s["rows"] if num(r["t"]) - s["t0"] >= settle_s and num(r["batch_size"]) > 0]
        if not settled or s["users"] == 0:
            continue

        phase = "peak" if s["users"] == peak else ("down" if seen_peak else "up")
        out.append({"phase": phase, "users": s["users"], "seconds": len(settled),
                    **{k: _mean(settled, k) for k in ("batch_size", "theta", "node_cap", "tree_size", "width",
                                            "accepted_per_round", "goodput_tok_s", "p50_e2e_s", "p99_e2e_s")}})
    return out


def ramp_summary(csv_path: Path, settle_s: float = 8.0) -> str:
    levels = ramp_levels(read_rows(csv_path), settle_s)
    head = ["phase", "users", "batch", "theta", "node cap", "tree size", "width", "accepted/round",
            "goodput tok/s", "p50 e2e s", "p99 e2e s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in levels:
        lines.append("| " + " | ".join([lv["phase"], str(lv["users"])] + [
            f"{lv[k]:.3g}" for k in ("batch_size", "theta", "node_cap", "tree_size", "width", "accepted_per_round",
                                     "goodput_tok_s", "p50_e2e_s", "p99_e2e_s")]) + " |")
    if levels:
        low = min((lv for lv in levels if lv["phase"] == "up"), key=lambda lv: lv["users"], default=levels[0])
        high = max(levels, key=lambda lv: lv["users"])
        back = [lv for lv in levels if lv["phase"] == "down"]
        ratio = low["tree_size"] / high["tree_size"] if high["tree_size"] > 0 else math.inf
        lines.append("")
        lines.append(f"mean tree size at {low['users']} user(s): {low['tree_size']:.2f}; at {high['users']}: "
                     f"{high['tree_size']:.2f} (ratio {ratio:.1f}x); width at the top: {high['width']:.2f}")
        if back:
            last = min(back, key=lambda lv: lv["users"])
            lines.append(f"back down at {last['users']} user(s): tree size {last['tree_size']:.2f} "
                         f"({last['tree_size'] / low['tree_size']:.0%} of the way up)" if low["tree_size"] else "")
    return "\n".join(lines)


def _compare_grid(rows: list[dict]) -> tuple[list[str], list[int], dict[tuple[str, int], dict]]:
    """Per (policy, users): the median run's row, with ``spread`` (max - min goodput over
    the runs, 0 for one run), ``runs`` and ``goodputs`` (every run's, ascending)."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    users = sorted({int(r["users"]) for r in rows})
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], int(r["users"])), []).append(r)
    grid = {}
    for k, rs in groups.items():
        g = sorted(rs, key=lambda r: num(r["goodput_tok_s"]))
        vals = [num(r["goodput_tok_s"]) for r in g]
        grid[k] = {**g[(len(g) - 1) // 2], "goodput_tok_s": statistics.median(vals),
                   "spread": max(vals) - min(vals), "runs": len(g), "goodputs": vals}
    return policies, users, grid


def tie_ratio(cv: float, contenders: int, runs: int, *, rng: np.random.Generator, draws: int = 20_000) -> float:
    """What ``subject / best other`` comes out as when the subject and ``contenders``
    other policies serve exactly alike: each cell the median of ``runs`` runs with
    run-to-run coefficient of variation ``cv`` (normal), the best of the contenders'
    medians taken. The median over ``draws``: the ratio noise alone gives a tie."""
    if contenders < 1 or cv <= 0:
        return 1.0
    med = np.median(rng.normal(1.0, cv, size=(draws, contenders + 1, runs)), axis=2)
    return float(np.median(med[:, 0] / med[:, 1:].max(axis=1)))


def level_noise(grid: dict[tuple[str, int], dict], users: int) -> float:
    """The run-to-run coefficient of variation at one level, pooled over its policies
    (root mean square of each cell's sample cv; 0 with fewer than two runs)."""
    cvs = [statistics.stdev(c["goodputs"]) / statistics.mean(c["goodputs"])
           for (p, u), c in grid.items() if u == users and len(c["goodputs"]) > 1 and statistics.mean(c["goodputs"])]
    return math.sqrt(sum(x * x for x in cvs) / len(cvs)) if cvs else 0.0


def compare_table(csv_path: Path) -> str:
    """Goodput per policy and users (median of the runs, +- half the spread), and the
    subject's (``perstep``, else ``adaptive``) ratios to the best other policy, to the
    ladder and to off."""
    policies, users, grid = _compare_grid(read_rows(csv_path))
    subject = "perstep" if "perstep" in policies else "adaptive"
    others = [p for p in policies if p != subject]
    head = ["users"] + [f"{p} tok/s" for p in policies]
    if subject in policies and others:
        head += [f"{subject} / best other", f"{subject} / ladder" if "ladder" in policies else "-",
                 f"{subject} - off (off spread)" if "off" in policies else "-"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = []
    for u in users:
        g = {p: grid[(p, u)]["goodput_tok_s"] if (p, u) in grid else math.nan for p in policies}
        cells = [str(u)]
        for p in policies:
            r = grid.get((p, u))
            cells.append("" if r is None else
                         f"{g[p]:.1f} ±{r['spread'] / 2:.1f} (tree {num(r.get('tree_size')):.1f})")
        if subject in policies and others:
            best = max((g[p] for p in others if not math.isnan(g[p])), default=math.nan)
            ratios.append(g[subject] / best if best else math.nan)
            cells.append(f"{ratios[-1]:.2f}" if best else "")
            cells.append(f"{g[subject] / g['ladder']:.2f}" if "ladder" in policies and g["ladder"] else "-")
            cells.append(f"{g[subject] - g['off']:+.1f} ({grid[('off', u)]['spread']:.1f})"
                         if (("off", u) in grid and (subject, u) in grid) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    good = [x for x in ratios if x == x and x > 0]
    if good:
        runs = max(r["runs"] for r in grid.values())
        lines += ["", f"{subject} / best other, geometric mean over the levels: "
                  f"{statistics.geometric_mean(good):.3f}; lowest {min(good):.3f} "
                  f"(medians of {runs} run(s) per cell)"]
        if runs > 1:
            lines += ["", _tie_line(subject, others, users, grid, runs)]
    return "\n".join(lines)


def _tie_line(subject: str, others: list[str], users: list[int], grid: dict, runs: int) -> str:
    """Per level, the ratio a tie would show: the subject serving exactly like every
    other policy within two cv of the best other (its contenders), at the level's noise."""
    rng = np.random.default_rng(0)
    cells, ties = [], []
    for u in users:
        g = {p: grid[(p, u)]["goodput_tok_s"] for p in others if (p, u) in grid}
        if not g or (subject, u) not in grid:
            continue
        cv, best = level_noise(grid, u), max(g.values())
        k = sum(x >= best * (1 - 2 * cv) for x in g.values())
        ties.append(tie_ratio(cv, k, runs, rng=rng))
        cells.append(f"{u}: {ties[-1]:.2f} (cv {cv:.2f}, {k} contender(s))")
    return (f"{subject} / best other if {subject} served exactly like its contenders (the others within two "
            f"run-to-run cv of the best), from noise alone: " + "; ".join(cells)
            + (f"; geometric mean {statistics.geometric_mean(ties):.3f}" if ties else ""))


def compare_detail(csv_path: Path) -> str:
    """Per users and policy, the median run's speculation and latency next to its goodput:
    what each policy ran (tree size, theta), the queue (mean requests waiting
    beyond the batches, and the most on one replica at any poll) and the latencies."""
    policies, users, grid = _compare_grid(read_rows(csv_path))
    head = ["users", "policy", "goodput tok/s (runs)", "tree", "theta", "queued (max on a replica)",
            "p50 TTFT s", "p50 e2e s", "p99 e2e s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for u in users:
        for p in policies:
            r = grid.get((p, u))
            if r is None:
                continue
            lines.append("| " + " | ".join([
                str(u), p, f"{num(r['goodput_tok_s']):.1f} ({', '.join(f'{v:.1f}' for v in r['goodputs'])})",
                f"{num(r.get('tree_size')):.1f}", f"{num(r.get('theta')):.2f}",
                f"{num(r.get('queued')):.1f} ({num(r.get('queued_max')):.0f})",
                f"{num(r.get('p50_ttft_s')):.2f}", f"{num(r.get('p50_e2e_s')):.2f}", f"{num(r.get('p99_e2e_s')):.2f}"]) + " |")
    return "\n".join(lines)


def plot_compare(csv_path: Path, png_path: Path, title: str = "") -> None:
    policies, users, grid = _compare_grid(read_rows(csv_path))
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / max(len(policies), 1)
    for i, p in enumerate(policies):
        ys = [grid[(p, u)]["goodput_tok_s"] if (p, u) in grid else 0 for u in users]
        err = [grid[(p, u)]["spread"] / 2 if (p, u) in grid else 0 for u in users]
        ax.bar([j + i * w for j in range(len(users))], ys, w, yerr=err, capsize=2, label=p)
    ax.set_xticks([j + w * (len(policies) - 1) / 2 for j in range(len(users))], [str(u) for u in users])
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("goodput (tokens/s), median of runs")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title or "goodput by policy and concurrency")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    for p in map(Path, argv if argv is not None else sys.argv[1:]):
        if p.name.startswith("compare"):
            plot_compare(p, p.with_suffix(".png"))
            print(compare_table(p))
            print()
            print(compare_detail(p))
        else:
            plot_timeline(p, p.with_suffix(".png"))
            print(ramp_summary(p))


if __name__ == "__main__":
    main()

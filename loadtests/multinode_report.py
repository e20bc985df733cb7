"""Plots of the multi-node experiments (``loadtests.multinode`` writes the CSVs).

* ``plot_fault``  replicas per node, answered and failed requests per second (streaming
                  and not) and goodput, with the moment the worker was killed;
* ``plot_ramp``   users and replicas, each replica's price (theta), and goodput.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtests.report import num, read_rows  # noqa: E402


def _by_poll(rows: list[dict]) -> dict[float, list[dict]]:
    polls: dict[float, list[dict]] = defaultdict(list)
    for r in rows:
        polls[num(r["t"])].append(r)
    return dict(sorted(polls.items()))


def _per_second(path: Path, key: str, kind: str | None = None) -> tuple[list[int], list[float]]:
    acc: dict[int, float] = defaultdict(float)
    for r in read_rows(path):
        if kind is None or r["kind"] == kind:
            acc[int(r["t"])] += num(r[key])
    if not acc:
        return [], []
    ts = list(range(0, max(acc) + 1))
    return ts, [acc.get(t, 0.0) for t in ts]


def plot_fault(timeline: Path, requests: Path, t_kill: float, png: Path) -> None:
    polls = _by_poll(read_rows(timeline))
    nodes = sorted({r["node"] for rs in polls.values() for r in rs if r.get("node")})
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    t = list(polls)
    for n in nodes:
        axes[0].plot(t, [sum(1 for r in rs if r.get("node") == n) for rs in polls.values()], label=f"node {n}",
                     drawstyle="steps-post")
    axes[0].set_ylabel("replicas\n(controller's view)", fontsize=8)
    for kind in ("stream", "plain"):
        xs, ys = _per_second(requests, "answered", kind)
        axes[1].plot(xs, ys, label=f"{kind} answered")
        fx, fy = _per_second(requests, "failed", kind)
        axes[1].plot([x for x, y in zip(fx, fy, strict=True) if y], [y for y in fy if y], "x", ms=8,
                     label=f"{kind} failed")
    axes[1].set_ylabel("requests / s", fontsize=8)
    xs, ys = _per_second(requests, "tokens")
    axes[2].plot(xs, ys, label="tokens/s answered")
    axes[2].set_ylabel("goodput (tok/s)", fontsize=8)
    for ax in axes:
        ax.axvline(t_kill, color="red", ls="--", lw=1)
    _finish(fig, axes, "a worker node killed under load (red line)", png)


def plot_ramp(timeline: Path, requests: Path, png: Path) -> None:
    polls = _by_poll(read_rows(timeline))
    t = list(polls)
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].plot(t, [num(rs[0]["users"]) for rs in polls.values()], label="users", drawstyle="steps-post")
    axes[0].plot(t, [sum(1 for r in rs if r["replica"]) for rs in polls.values()], label="replicas (registered)",
                 drawstyle="steps-post")
    axes[0].set_ylabel("users / replicas", fontsize=8)
    replicas = list(dict.fromkeys(r["replica"] for rs in polls.values() for r in rs if r["replica"]))  # by arrival
    for i, rid in enumerate(replicas):
        pts = [(tt, num(r["theta"])) for tt, rs in polls.items() for r in rs if r["replica"] == rid]
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=3, label=f"replica {i + 1} ({rid})")
    axes[1].set_ylabel("price theta\n(each replica's budget)", fontsize=8)
    axes[1].set_yscale("log")
    xs, ys = _per_second(requests, "tokens")
    axes[2].plot(xs, ys, label="tokens/s answered (requests ending that second)")
    axes[2].plot(t, [sum(num(r.get("tokens_per_s")) for r in rs if r["replica"]) for rs in polls.values()],
                 label="tokens/s (replicas' reports)", alpha=0.6)
    axes[2].set_ylabel("goodput (tok/s)", fontsize=8)
    _finish(fig, axes, "autoscaling 1 -> 3 -> 1 replicas on two worker nodes", png)


def _finish(fig, axes, title: str, png: Path) -> None:
    """Grid and legend on every panel, the title on top, time below; save and close."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_title(title)
    axes[-1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)

"""Before and after, side by side: a measurement run on this checkout and on an older one.

A benchmark file that can run as a script (``python FILE --measure ...``, printing one
JSON line last) is run in a subprocess whose ``treespark`` is the checkout's
(``run_at``): the file is this checkout's, its imports the other's, so it must use only
the interface both share. ``in_turn`` alternates the sides, so that a machine's load
drifting during the benchmark falls on both alike. Standard library only: the script
side imports nothing of this checkout's ``treespark``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # this checkout


def run_at(checkout: Path | None, script: str, args: list[str], threads: str = "1") -> dict:
    """``script`` (a file of this checkout) with ``args`` in a subprocess whose
    ``treespark`` is ``checkout``'s (None: this one), ``OMP_NUM_THREADS`` as the caller's
    or ``threads``: the JSON of its last line of output."""
    root = checkout or ROOT
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    res = subprocess.run([sys.executable, str(Path(script).resolve()), *args], env=env, cwd=root,
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def in_turn(base: Path | None, rounds: int, measure: Callable[[Path | None], dict]) -> dict[str, list[dict]]:
    """``measure`` of each side ("before": ``base``, if any; "after": this checkout)
    ``rounds`` times, the sides in turn (before, after; then after, before; ...)."""
    sides = {"before": base, "after": None} if base is not None else {"after": None}
    runs: dict[str, list[dict]] = {label: [] for label in sides}
    for r in range(rounds):
        for label in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            runs[label].append(measure(sides[label]))
    return runs

"""What machine this is, and the cache of what was measured on it (the product plan,
the step-cost table). ``hardware_name``: the accelerator's name, or the CPU's model
name and a digest of its instruction-set flags (two CPUs sold under one name can differ
in AVX-512 or AMX, and so in which matrix product is fastest). ``read_cached`` /
``write_cached``: a JSON file per measurement key, guarded by a ``filelock`` and
replaced whole, so that replicas starting together never read a torn file."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock


def hardware_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    name, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name is None:
                name = value.strip()
            elif key.strip() == "flags" and flags is None:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return f"{name} [{hashlib.sha256(flags.encode()).hexdigest()[:8]}]" if flags else name


def read_cached(path: Path) -> dict[str, Any] | None:
    """The JSON object cached at ``path``, or None where there is none or it cannot be read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            return None
        try:
            d = json.loads(path.read_text())
        except ValueError:
            return None
        return d if isinstance(d, dict) else None


def write_cached(path: Path, data: dict[str, Any]) -> None:
    """Writes ``data`` at ``path`` as JSON: a temporary file, then replaced whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)

"""What machine this is, for the caches of what was measured on it (the product plan,
the step-cost table): the accelerator's name, or the CPU's model name and a digest of
its instruction-set flags (two CPUs sold under one name can differ in AVX-512 or AMX,
and so in which matrix product is fastest)."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import torch


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

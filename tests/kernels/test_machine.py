"""treespark.kernels.machine: the machine's name for per-machine caches, and the cache files."""

from pathlib import Path

import torch

from treespark.kernels.machine import hardware_name, read_cached, write_cached


def test_cache_files_round_trip_and_unreadable_ones_read_as_absent(tmp_path):
    path = tmp_path / "deep" / "k.json"
    assert read_cached(path) is None
    write_cached(path, {"rows": [1, 2], "layouts": ["F.linear", "F.linear"]})
    assert read_cached(path) == {"rows": [1, 2], "layouts": ["F.linear", "F.linear"]}
    assert not list(path.parent.glob("*.tmp")), "the temporary file is replaced, not left"
    path.write_text("{torn")
    assert read_cached(path) is None
    path.write_text("[1, 2]")
    assert read_cached(path) is None


def test_a_cpu_is_named_with_a_digest_of_its_flags():
    name = hardware_name()
    assert name
    cpuinfo = Path("/proc/cpuinfo")
    if not torch.cuda.is_available() and cpuinfo.exists() and "flags" in cpuinfo.read_text():
        assert name.endswith("]") and len(name.rsplit("[", 1)[1]) == 9  # "[" + 8 hex digits + "]"

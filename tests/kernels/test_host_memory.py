"""``treespark.kernels.host_memory``: a CPU engine's freed temporaries are reused, not
mapped afresh (page faults counted by the kernel)."""

import platform
import resource
import subprocess
import sys

import pytest

from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.models.pair import random_pair

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# a vocabulary-sized temporary written, dropped, and made again: the page faults of the second one
SECOND_FAULTS = """
import resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
n = 10 * 2**20                                  # 40 MB, over glibc's largest mmap threshold
a = torch.empty(n); a.fill_(1.0); del a
f0 = faults(); b = torch.empty(n); b.fill_(1.0)
print(faults() - f0)
"""


def _second_faults(prelude: str) -> int:
    out = subprocess.run([sys.executable, "-c", prelude + SECOND_FAULTS], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_cpu_engine_reuses_a_freed_temporary_without_faulting_its_pages():
    pages = 10 * 2**20 * 4 // resource.getpagesize()
    # without the setting: every page of the second temporary is faulted in again
    assert _second_faults("") > pages // 2
    # an engine on the CPU sets it: its pages are the first one's
    engine = ("from treespark.models.pair import random_pair\n"
              "from treespark.engine.core import Engine\nfrom treespark.engine.config import EngineConfig\n"
              "Engine(random_pair(64, 0, block_size=3), EngineConfig(max_batch_size=1, max_context=32))\n")
    assert _second_faults(engine) < pages // 100


@glibc
def test_the_setting_says_it_took():
    from treespark.kernels.host_memory import keep_freed_memory

    Engine(random_pair(64, 0, block_size=3), EngineConfig(max_batch_size=1, max_context=32))
    assert keep_freed_memory() is True

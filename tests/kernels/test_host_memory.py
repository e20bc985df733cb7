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

# a vocabulary-sized temporary written and dropped, round after round (as a step's are): the
# page faults of the last rounds
LAST_FAULTS = """
import resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
n = 10 * 2**20                                  # 40 MB, over glibc's largest mmap threshold
for _ in range(12):
    a = torch.empty(n); a.fill_(1.0); del a
f0 = faults()
for _ in range(4):
    a = torch.empty(n); a.fill_(1.0); del a
print(faults() - f0)
"""


def _last_faults(prelude: str) -> int:
    out = subprocess.run([sys.executable, "-c", prelude + LAST_FAULTS], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_cpu_engine_reuses_freed_temporaries_without_faulting_their_pages():
    """Without the setting every round maps the temporary afresh and faults in all its
    pages; with it, a freed block is reused once the heap's free space around it has
    coalesced (an aligned request asks a little more than the block it freed, and a small
    block allocated after it can hold it apart from the heap's top for a few rounds: up
    to six seen here), and from then on no page is faulted again."""
    pages = 10 * 2**20 * 4 // resource.getpagesize()
    assert _last_faults("") > 4 * pages // 2
    engine = ("from treespark.models.pair import random_pair\n"
              "from treespark.engine.core import Engine\nfrom treespark.engine.config import EngineConfig\n"
              "Engine(random_pair(64, 0, block_size=3), EngineConfig(max_batch_size=1, max_context=32))\n")
    assert _last_faults(engine) < pages // 100


@glibc
def test_the_setting_says_it_took():
    from treespark.kernels.host_memory import keep_freed_memory

    Engine(random_pair(64, 0, block_size=3), EngineConfig(max_batch_size=1, max_context=32))
    assert keep_freed_memory() is True

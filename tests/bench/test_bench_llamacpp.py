"""llama.cpp's rows in treespark bench wallclock: skipped with a note without the extra,
and, where llama-cpp-python is installed, a tiny timed run on the default target's GGUF."""

import sys

import pytest

from treespark import random_pair
from treespark.bench.llamacpp import INSTALL_HINT, time_llamacpp
from treespark.bench.wallclock import wallclock_benchmark


def test_wallclock_skips_the_llamacpp_rows_with_one_line_when_llama_cpp_is_absent(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # any import of it raises ImportError
    logged = []
    table = wallclock_benchmark(random_pair(64, 0, block_size=4), n_prompts=1, max_tokens=3, chains=(1,),
                                temperatures=(0.0,), profile_s=None, gguf=tmp_path / "target.gguf",
                                bandwidth_bytes=1 << 16, log=logged.append)
    decoders = [line.split("|")[2].strip() for line in table.splitlines()[2:] if line.startswith("|")]
    assert decoders and not any(d.startswith("llama.cpp") for d in decoders)
    skipped = [line for line in table.split("\n\n") if line.startswith("llama.cpp rows skipped")]
    assert skipped == [f"llama.cpp rows skipped: llama_cpp is not installed: {INSTALL_HINT}."]
    assert [line for line in logged if "llama.cpp" in line] == skipped  # printed once, as it is
    assert "served default / llama.cpp" not in table
    assert "our plain decoding" in table.split("\n\n")[-1]  # the bandwidth-limit line still comes


def test_llamacpp_times_greedy_and_prompt_lookup_on_the_default_gguf():
    pytest.importorskip("llama_cpp", reason="the bench-only extra treespark[llamacpp] is not installed")
    from treespark.models.fetch import fetch_gguf

    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9]]
    for lookup in (0, 3):
        r = time_llamacpp(fetch_gguf(progress=False), prompts, 4, stop_token_ids=(), n_threads=1,
                          lookup_tokens=lookup)
        assert r.tokens == 8 and r.wall_s > 0  # no stop token: every prompt runs to its budget


def test_a_llamacpp_process_that_ends_without_a_result_fails_its_rows_not_the_bench(monkeypatch, tmp_path):
    import treespark.bench.wallclock as wallclock
    from treespark.bench.llamacpp import LlamaCppFailed

    # the child process: a GGUF that is not there (or no llama_cpp) ends it with an error
    with pytest.raises(LlamaCppFailed, match="exit code 1"):
        time_llamacpp(tmp_path / "missing.gguf", [[1, 2, 3]], 2, stop_token_ids=(), n_threads=1)

    def dies(*args, **kwargs):
        raise LlamaCppFailed("llama.cpp's process ended with signal SIGILL (no output)")

    monkeypatch.setattr(wallclock, "llama_cpp_version", lambda: "0.3.36")
    monkeypatch.setattr(wallclock, "time_llamacpp", dies)
    logged = []
    table = wallclock_benchmark(random_pair(64, 0, block_size=4), n_prompts=1, max_tokens=3, chains=(1,),
                                temperatures=(0.0,), profile_s=None, gguf=tmp_path / "target.gguf",
                                bandwidth_bytes=1 << 16, log=logged.append)
    skipped = [line for line in table.split("\n\n") if " skipped: " in line]
    assert skipped == [f"llama.cpp {kind} skipped: llama.cpp's process ended with signal SIGILL (no output)."
                       for kind in ("greedy", "prompt lookup")]
    assert "served default / llama.cpp" not in table

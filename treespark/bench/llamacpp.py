"""llama.cpp at batch 1 on the default target's own GGUF: the reference row of the
wall-clock bench.

The default target ships as a ``Q4_1`` GGUF (``treespark.models.fetch.fetch_gguf``);
llama.cpp runs that file as it is, through llama-cpp-python (the bench-only extra
``treespark[llamacpp]``, imported only here and only when called). Greedy decoding
from the same prompt token ids, the same token budget and stop tokens as our engine,
one request at a time from an empty KV cache, prefill included in the time. Its own
speculative mode, as llama-cpp-python exposes it, is prompt lookup
(``LlamaPromptLookupDecoding``: drafts copied from an earlier n-gram match in the
context, verified in one forward).

llama.cpp runs in a child process (``python -m treespark.bench.llamacpp``): a build that
dies in its own code (a native build whose instructions the machine refuses, seen as
SIGILL on an AMX Xeon whose kernel does not grant AMX) fails its rows, not the bench.
"""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "pip install 'treespark[llamacpp]' (builds llama-cpp-python from source)"


@dataclass(frozen=True)
class LlamaCppRun:
    """What one llama.cpp pass over the prompts produced."""

    tokens: int  # new tokens over every prompt
    wall_s: float  # prefill and decode, every prompt, model load excluded

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version, or None when it is not installed."""
    try:
        return importlib.import_module("llama_cpp").__version__
    except ImportError:
        return None


class LlamaCppFailed(RuntimeError):
    """llama.cpp's child process ended without a result (the message says how)."""


def time_llamacpp(gguf: Path, prompts: list[list[int]], max_tokens: int, *, stop_token_ids: tuple[int, ...],
                  n_threads: int, lookup_tokens: int = 0) -> LlamaCppRun:
    """Batch-1 greedy decoding of each prompt (token ids) by llama.cpp on ``gguf``, after
    an untimed warm-up request, in a child process (``_time_here``). ``lookup_tokens`` >
    0: llama-cpp-python's prompt lookup decoding, drafting that many tokens a round.
    Raises LlamaCppFailed where the child ends without a result (without the extra, too)."""
    args = {"gguf": str(gguf), "prompts": prompts, "max_tokens": max_tokens, "stop_token_ids": list(stop_token_ids),
            "n_threads": n_threads, "lookup_tokens": lookup_tokens}
    res = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(args), capture_output=True, text=True)
    if res.returncode != 0:
        how = f"signal {signal.Signals(-res.returncode).name}" if res.returncode < 0 else f"exit code {res.returncode}"
        last = res.stderr.strip().splitlines()[-1:] or ["no output"]
        raise LlamaCppFailed(f"llama.cpp's process ended with {how} ({last[0][:200]})")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return LlamaCppRun(out["tokens"], out["wall_s"])


def _time_here(gguf: Path, prompts: list[list[int]], max_tokens: int, *, stop_token_ids: tuple[int, ...],
               n_threads: int, lookup_tokens: int = 0) -> LlamaCppRun:
    """``time_llamacpp``'s measurement, in this process."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    assert prompts and max_tokens > 0 and n_threads > 0
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens > 0 else None
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(len(p) for p in prompts) + max_tokens + 16,
                          n_threads=n_threads, n_threads_batch=n_threads, draft_model=draft, verbose=False)
    stops = set(stop_token_ids)

    def one(prompt: list[int], budget: int) -> int:
        llm.reset()  # no KV prefix kept from the last request: each one starts cold, as ours do
        n = 0
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            n += 1
            if n >= budget or token in stops:
                break
        return n

    try:
        one(prompts[0], min(max_tokens, 16))  # warm-up, untimed
        t0 = time.perf_counter()
        tokens = sum(one(p, max_tokens) for p in prompts)
        return LlamaCppRun(tokens, time.perf_counter() - t0)
    finally:
        llm.close()


if __name__ == "__main__":   # the child of ``time_llamacpp``: its arguments as JSON on stdin, the run on stdout
    a = json.loads(sys.stdin.read())
    r = _time_here(Path(a["gguf"]), a["prompts"], a["max_tokens"], stop_token_ids=tuple(a["stop_token_ids"]),
                   n_threads=a["n_threads"], lookup_tokens=a["lookup_tokens"])
    print(json.dumps({"tokens": r.tokens, "wall_s": r.wall_s}))

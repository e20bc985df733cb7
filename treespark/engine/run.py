"""Running the engine over prompts (there is one decode loop): ``generate`` for one
request, ``run_engine`` for a batch of prompts timed, ``target_answers`` for the target's
own answers."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from tqdm import tqdm

from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.step_alloc import StepAllocator
from treespark.models.pair import ModelPair
from treespark.spec.budget import Budget
from treespark.spec.params import RequestStats, RoundStats, SamplingParams, StepStats


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]              # the new tokens only
    rounds: list[RoundStats]          # one per target forward after prefill
    finish_reason: str
    stats: RequestStats

    @property
    def tokens_per_round(self) -> float:
        return self.stats.tokens_per_round


def generate(
    pair: ModelPair,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    budget: Budget | None = None,
    top_p: float = 1.0,
    stop_token_ids: tuple[int, ...] = (),
    reproducible: bool = False,
) -> Generation:
    """Decode ``max_new_tokens`` after ``prompt_ids`` with speculative draft trees.

    ``budget=None`` is the default adaptive tree; ``Budget.chain(k)`` a chain and
    ``Budget.off()`` plain decoding. The output has exactly the target's distribution
    (greedy: the target's tokens); ``reproducible`` (T > 0, with a seed): the tokens are
    a function of the prompt and the seed alone, the same under every budget
    (``SamplingParams.reproducible``). Raises ValueError on bad input.
    """
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids, seed=seed, reproducible=reproducible)
    if budget is not None and not isinstance(budget, Budget):
        raise ValueError(f"budget must be a treespark.Budget or None, got {type(budget).__name__}")
    n = len(prompt_ids) if hasattr(prompt_ids, "__len__") else 0
    engine = Engine(pair, EngineConfig(max_batch_size=1, max_context=max(n, 1) + max_new_tokens,
                                       prefill_chunk=max(n, 1)),
                    budget=budget or Budget.adaptive())
    engine.add_request("generate", prompt_ids, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                assert out.stats is not None and out.finish_reason is not None
                return Generation(tokens, list(out.stats.round_stats), out.finish_reason, out.stats)
    raise RuntimeError("the engine stopped without finishing the request")


@dataclass(frozen=True)
class RunResult:
    token_ids: tuple[tuple[int, ...], ...]   # the new tokens of each prompt, in prompt order
    wall_s: float
    steps: int
    rounds: int
    accepted: int
    drafted: int
    step_stats: tuple[StepStats, ...]

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward, per request (accepted + 1 per round)."""
        return (self.accepted + self.rounds) / max(self.rounds, 1)


def run_engine(pair: ModelPair, prompts: list[list[int]], budget: Budget, *, max_tokens: int,
               batch_size: int, temperature: float = 0.0, seed: int = 0, reproducible: bool = False,
               allocator: StepAllocator | None = None, progress: bool = False,
               around: Callable[[], AbstractContextManager] = nullcontext) -> RunResult:
    """Serve every prompt through one engine (batch_size rows) and time it; prompt ``i``
    samples with seed ``seed + i`` (``reproducible``: ``SamplingParams.reproducible``).
    With ``allocator``, every step is priced by it (the served per-step policy). The
    steps, and only they (not the engine's construction), run inside ``around()`` (e.g.
    a profiler) and are timed (``RunResult.wall_s``)."""
    longest = max(len(p) for p in prompts)
    engine = Engine(pair, EngineConfig(max_batch_size=batch_size, max_context=longest + max_tokens),
                    budget=budget)
    engine.set_allocator(allocator)
    stats: list[StepStats] = []
    engine.on_step = stats.append
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed + i, reproducible=reproducible,
            stop_token_ids=pair.stop_token_ids))
    answers: list[list[int]] = [[] for _ in prompts]
    rounds = accepted = drafted = steps = 0
    bar = tqdm(total=len(prompts), desc="engine", unit="prompt", disable=not progress)
    with around():
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                answers[int(out.request_id)] += out.new_token_ids
                if out.finished and out.stats is not None:
                    rounds += out.stats.rounds
                    accepted += out.stats.accepted_tokens
                    drafted += out.stats.drafted_tokens
                    bar.update(1)
            steps += 1
        wall = time.perf_counter() - t0
    bar.close()
    return RunResult(tuple(tuple(a) for a in answers), wall, steps, rounds, accepted, drafted, tuple(stats))


def target_answers(pair: ModelPair, prompts: list[list[int]], max_tokens: int,
                   *, temperature: float = 0.0, seed: int = 0, batch_size: int = 16,
                   progress: bool = True) -> list[list[int]]:
    """Each prompt followed by the target's own answer (plain decoding, batched)."""
    r = run_engine(pair, prompts, Budget.off(), max_tokens=max_tokens, batch_size=batch_size,
                   temperature=temperature, seed=seed, progress=progress)
    return [list(p) + list(a) for p, a in zip(prompts, r.token_ids, strict=True)]

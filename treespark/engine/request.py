"""One request inside the engine: its record (``Request``: prompt, sampler, output, KV
blocks, rounds), the checks that admit it (``check_request``, ``validate_prompt``), the
rule that finishes it (``clip_emitted``: ``max_tokens`` first, then stop tokens) and what
a step hands back for it (``emit``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treespark.kernels.transfer import HostTransfers
from treespark.spec.budget import Budget
from treespark.spec.logprobs import TokenLogprob
from treespark.spec.params import RequestOutput, RequestStats, RoundStats, SamplingParams
from treespark.spec.sampling import TorchSampler


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    sampler: TorchSampler
    budget: Budget | None                 # None: follow the engine's budget
    output: list[int] = field(default_factory=list)
    root: int = -1                        # the last emitted token, not yet in the KV
    blocks: list[int] = field(default_factory=list)   # its block table (``treespark.engine.kv``)
    keys: list[bytes] = field(default_factory=list)   # prefix-cache keys of its full committed blocks
    computed: int = 0                     # positions whose KV is committed
    seq: int = -1                         # admission order (the newest is preempted first)
    scheduled: bool = False               # has left the waiting queue once
    rounds: list[RoundStats] = field(default_factory=list)
    # the target's tapped states of the positions processed so far, in order (on the
    # device), kept only when the request asked (``Engine.add_request(capture_taps=True)``)
    taps: list[torch.Tensor] | None = None

    @property
    def next_index(self) -> int:
        """The absolute index of the next token to emit: the prompt's and the output's so far."""
        return len(self.prompt) + len(self.output)

    @property
    def prefill_len(self) -> int:
        """The positions to prefill before decoding: the prompt, or after a preemption
        the prompt and every emitted token but the last (the root of the next tree)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    def stats(self) -> RequestStats:
        drafted = sum(r.tree_size for r in self.rounds)
        return RequestStats(
            prompt_tokens=len(self.prompt),
            generated_tokens=len(self.output),
            rounds=len(self.rounds),
            drafted_tokens=drafted,
            accepted_tokens=sum(r.accepted for r in self.rounds),
            mean_tree_size=drafted / len(self.rounds) if self.rounds else 0.0,
            round_stats=tuple(self.rounds),
        )


def check_request(prompt_ids, params: SamplingParams, max_context: int, vocab_size: int) -> list[int]:
    """The prompt as a list of ints, if the request can ever run in an engine of
    ``max_context`` tokens over ``vocab_size`` ids; else ValueError saying what is wrong."""
    prompt = validate_prompt(prompt_ids, vocab_size)
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    if len(prompt) + params.max_tokens > max_context:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"engine's max_context of {max_context} tokens")
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise ValueError(f"stop token ids {bad_stop} are outside the vocabulary of {vocab_size}")
    return prompt


def validate_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """Check a prompt: a non-empty list of integer token ids inside the vocabulary."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise ValueError("prompt_ids must be a list of token ids")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: at least one token is needed")
    if (isinstance(prompt_ids, list) and set(map(type, prompt_ids)) == {int}
            and 0 <= min(prompt_ids) and max(prompt_ids) < vocab_size):
        return list(prompt_ids)  # the usual prompt, checked at C speed (the loop below names what is wrong)
    prompt = []
    for t in prompt_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_floating_point():
                t = int(t)
            else:
                raise ValueError(f"prompt_ids must hold integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} is outside the vocabulary (0..{vocab_size - 1})")
        prompt.append(int(t))
    return prompt


def clip_emitted(tokens: list[int], params: SamplingParams, generated: int) -> tuple[list[int], str | None]:
    """The tokens a round may emit after ``generated`` earlier ones, and why the request
    finishes (None: it goes on): "length" once ``max_tokens`` is reached, "stop" at the
    first stop token (kept)."""
    reason = None
    room = params.max_tokens - generated
    if len(tokens) >= room:
        tokens, reason = tokens[:room], "length"
    stops = set(params.stop_token_ids)
    for j, t in enumerate(tokens):
        if t in stops:
            tokens, reason = tokens[: j + 1], "stop"
            break
    return tokens, reason


def emit(req: Request, tokens: list[int], transfers: HostTransfers, *, first: bool = False,
         logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """Append a step's tokens to ``req``'s output, clipped by ``max_tokens`` and its stop
    tokens, and say so: the output to hand back (``finished`` set when the request ends
    here; its captured taps fetched then, one copy). ``first``: the request's first token,
    from its prefill (it becomes the root of the first tree)."""
    tokens, reason = clip_emitted(tokens, req.params, len(req.output))
    req.output += tokens
    if first and reason is None:
        req.root = tokens[-1]
    finished = reason is not None
    lps = None if logprobs is None else tuple(logprobs[:len(tokens)])
    taps = None
    if finished and req.taps is not None:
        positions = len(req.prompt) + len(req.output) - 1
        taps = transfers.fetch(torch.cat(req.taps)[:positions].to(torch.float16))
    return RequestOutput(req.id, tokens, finished, reason, req.stats() if finished else None, lps, taps)

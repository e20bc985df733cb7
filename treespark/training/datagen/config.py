"""``GenConfig``: what a drafter-data run generates (shard size, batching, lengths, the
mix of request sources, temperatures, the repetition cut); its digest tags every shard."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GenConfig:
    version: str = "answers-1"
    conversations: int = 192                 # first-turn requests per shard (~7 min on 1 CPU thread)
    batch_size: int = 32                     # engine rows decoded together
    max_answer_tokens: int = 256
    max_question_tokens: int = 48            # for the target-written questions
    max_prompt_tokens: int = 384             # longer first-turn prompts are skipped
    max_context: int = 768                   # engine context: follow-ups must fit with an answer
    max_snippet_chars: int = 1200            # documentation / code pasted into a request
    # weights of the request sources: self-written, documentation, code[, chat templates]
    # (a fourth weight adds ``sources.CHAT_TEMPLATES``; three keep answers-1's plans and digest)
    mix: tuple[float, ...] = (0.45, 0.35, 0.20)
    greedy_fraction: float = 0.4             # the rest is sampled at one of ``temperatures``
    temperatures: tuple[float, ...] = (0.7, 0.8, 0.9, 1.0)
    question_temperature: float = 0.9
    subject_fraction: float = 0.6            # questions (and chat requests) on SUBJECTS; the rest on corpus nouns
    followup_fraction: float = 0.35          # of usable first answers
    ngram: int = 8                           # repetition cut: an n-gram of this length ...
    ngram_repeats: int = 3                   # ... occurring this many times (non-overlapping)
    min_answer_tokens: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations <= 0 or self.batch_size <= 0:
            raise ValueError("conversations and batch_size must be > 0")
        if len(self.mix) not in (3, 4) or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError("mix must be three or four non-negative weights (self-written, documentation, "
                             "code[, chat templates]), not all zero")
        if self.max_prompt_tokens + self.max_answer_tokens > self.max_context:
            raise ValueError("max_prompt_tokens + max_answer_tokens must fit in max_context")
        if not 0 <= self.greedy_fraction <= 1 or not 0 <= self.followup_fraction <= 1:
            raise ValueError("fractions must be in [0, 1]")
        if self.min_answer_tokens < 1:
            raise ValueError("min_answer_tokens must be >= 1")
        if self.ngram < 1 or self.ngram_repeats < 2:
            raise ValueError("ngram must be >= 1 and ngram_repeats >= 2")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

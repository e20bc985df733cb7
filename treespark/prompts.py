"""The project's prompt set: chat and code requests, split into train and heldout.

The prompts were written for this project (``assets/prompts/prompts.jsonl``, one JSON
object per line). Half are chat-style (explanations, short poems, tips, summaries,
everyday questions) and half code-style (Python functions, snippets to explain or fix,
shell one-liners, SQL). About a quarter of each kind is in the ``heldout`` split:
heldout prompts are for evaluation only, never for training or tuning a drafter or
a policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

SPLITS = ("train", "heldout")
KINDS = ("chat", "code")


@dataclass(frozen=True)
class Prompt:
    id: str  # unique, e.g. "chat-007"
    kind: str  # "chat" or "code"
    split: str  # "train" or "heldout"
    text: str  # the user message, possibly several lines

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Prompt.id must be a non-empty string, got {self.id!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Prompt {self.id}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.split not in SPLITS:
            raise ValueError(f"Prompt {self.id}: split must be one of {SPLITS}, got {self.split!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"Prompt {self.id}: text must be a non-empty string")


def load_prompts(split: str | None = None, kind: str | None = None) -> list[Prompt]:
    """The prompts in file order, optionally restricted to one split and/or kind."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS} or None")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS} or None")
    return [
        p
        for p in _all_prompts()
        if (split is None or p.split == split) and (kind is None or p.kind == kind)
    ]


def _all_prompts() -> list[Prompt]:
    source = resources.files("treespark") / "assets" / "prompts" / "prompts.jsonl"
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for lineno, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts.jsonl line {lineno}: invalid JSON: {e}") from e
        if not isinstance(row, dict) or set(row) != {"id", "kind", "split", "text"}:
            raise ValueError(
                f"prompts.jsonl line {lineno}: expected the keys id, kind, split, text"
            )
        prompt = Prompt(**row)
        if prompt.id in seen:
            raise ValueError(f"prompts.jsonl line {lineno}: duplicate id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    return prompts

"""Chat formatting: the one way a conversation becomes prompt token ids.

Serving (``POST /v1/chat/completions``), drafter training (``treespark.training.recipe``), the
benchmarks and ``treespark generate`` all call ``chat_ids``, so the prompts the drafter
was distilled on look exactly like the prompts it drafts for. The tokenizer is a
Hugging Face tokenizer or anything with the same two methods (``deployments.replica.text``'s
byte-level tokenizer for pairs without one). No torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: list[Any], *, add_generation_prompt: bool,
                            tokenize: bool) -> Any: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...


def chat_ids(tokenizer: ChatTokenizer, messages: str | Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokenizer's chat template over ``messages`` (a string: one user turn) with the
    assistant's turn opened, as token ids. The template's text is encoded without
    adding special tokens: the template writes its own."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))

"""The project's prompt set: chat and code requests, split into train and heldout.

The prompts were written for this project (``assets/prompts/prompts.jsonl``, one JSON
object per line). Half are chat-style (explanations, short poems, tips, summaries,
everyday questions) and half code-style (Python functions, snippets to explain or fix,
shell one-liners, SQL). About a quarter of each kind is in the ``heldout`` split:
heldout prompts are for evaluation only, never for training or tuning a drafter or
a policy.

Three templated sets complete it: ``synthetic_prompts()`` and ``varied_prompts()``
(training material for the drafter recipe; the second, larger one is read from
``assets/prompts/varied.json``) and ``tuning_prompts()`` (on other subjects; what
``treespark calibrate`` fits on and default budgets are chosen on). Training, tuning
and heldout texts never overlap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import torch

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


# Templated requests for drafter training only: more contexts in the style of the
# prompt set (chat and code), so the drafter sees many answers of the target.
_CHAT_TEMPLATES = (
    "Explain {x} in simple terms.",
    "Write a short poem about {x}.",
    "Give three practical tips about {x}.",
    "What are the main pros and cons of {x}?",
    "Summarize the history of {x} in a few sentences.",
    "Describe {x} to someone who has never heard of it.",
)
_CHAT_SUBJECTS = (
    "public libraries", "bicycles", "rainforests", "the moon", "coffee", "volcanoes",
    "learning a new language", "saving money", "gardening", "the ocean tides", "bees",
    "chess", "electric cars", "sleep", "the printing press", "photosynthesis", "jazz",
    "mountain hiking", "recycling", "the internet", "baking bread", "time zones",
    "friendship", "solar panels", "the Roman empire", "museums", "trains", "rain",
    "meditation", "board games", "vaccines", "deserts", "maps", "running a marathon",
    "owls", "cooking rice", "the water cycle", "public speaking", "autumn", "robots",
)
_CODE_TEMPLATES = (
    "Write a Python function that {x}.",
    "Show how to {x} in Python, with a short explanation.",
    "Write a small Python script to {x}, and explain each step.",
)
_CODE_TASKS = (
    "reverses the words in a sentence", "counts vowels in a string",
    "checks whether a number is prime", "merges two sorted lists",
    "reads a CSV file and prints the average of a column", "removes duplicates from a list",
    "finds the longest common prefix of a list of strings", "computes a factorial recursively",
    "flattens a nested list", "converts Celsius to Fahrenheit",
    "validates an email address with a regular expression", "returns the n-th Fibonacci number",
    "groups words by their first letter", "parses a date string into a datetime",
    "sorts a list of dictionaries by a key", "computes the median of a list",
    "reads a JSON file and pretty-prints it", "counts word frequencies in a text file",
    "implements binary search", "checks whether a string is a palindrome",
    "generates a random password", "walks a directory and lists all .txt files",
    "rotates a matrix by 90 degrees", "implements a simple stack class",
    "downloads nothing but simulates a retry loop with exponential backoff",
    "transposes a list of lists", "chunks a list into pieces of size n",
    "computes the greatest common divisor of two numbers", "formats a number with thousands separators",
    "memoizes an expensive function",
)


# Tuning requests: the same templates on subjects and tasks the drafter never saw in
# training, for fitting the calibration and choosing defaults. Neither training nor
# the heldout evaluation uses them.
_TUNE_SUBJECTS = (
    "glaciers", "the violin", "kites", "honey", "earthquakes", "origami", "submarines",
    "wind turbines", "the alphabet", "snow", "spices", "bridges",
)
_TUNE_TASKS = (
    "capitalizes the first letter of every word", "checks whether two strings are anagrams",
    "returns the second largest number in a list", "converts a Roman numeral to an integer",
    "counts the lines in a file", "computes a running average of a list",
    "finds all pairs in a list that sum to a target", "turns a list of pairs into a dictionary",
)


def _templated(subjects, tasks, prefix: str, seed: int) -> list[Prompt]:
    """The chat templates over ``subjects`` and the code templates over ``tasks``, in an
    order shuffled by ``seed``; ids keep each request's unshuffled index."""
    texts = [("chat", t.format(x=x)) for x in subjects for t in _CHAT_TEMPLATES]
    texts += [("code", t.format(x=x)) for x in tasks for t in _CODE_TEMPLATES]
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    return [Prompt(id=f"{prefix}-{i:03d}", kind=texts[i][0], split="train", text=texts[i][1]) for i in order]


def tuning_prompts() -> list[Prompt]:
    """Templated requests reserved for tuning (calibration, default budgets): never
    trained on, never used for the heldout evaluation."""
    return _templated(_TUNE_SUBJECTS, _TUNE_TASKS, "tune", seed=0)


def synthetic_prompts(seed: int = 0) -> list[Prompt]:
    """Every templated request (chat and code), in an order shuffled by ``seed``.

    Training material only. None of them equals a heldout prompt (checked)."""
    held = {p.text for p in load_prompts("heldout")}
    return [p for p in _templated(_CHAT_SUBJECTS, _CODE_TASKS, "synth", seed) if p.text not in held]


def varied_prompts(seed: int = 0) -> list[Prompt]:
    """The larger templated training pool (``assets/prompts/varied.json``: groups of
    templates, each filled with each of its group's items), in an order shuffled by
    ``seed``. Training material only: texts equal to a heldout or tuning prompt are
    dropped."""
    source = resources.files("treespark") / "assets" / "prompts" / "varied.json"
    groups = json.loads(source.read_text(encoding="utf-8"))["groups"]
    texts: list[tuple[str, str]] = []
    for g in groups:
        if g["kind"] not in KINDS:
            raise ValueError(f"varied.json: unknown kind {g['kind']!r}")
        texts += [(g["kind"], t.format(x=x)) for x in g["fill"] for t in g["templates"]]
    reserved = {p.text for p in load_prompts("heldout")} | {p.text for p in tuning_prompts()}
    texts = [kt for kt in dict.fromkeys(texts) if kt[1] not in reserved]
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    return [Prompt(id=f"varied-{i:04d}", kind=texts[i][0], split="train", text=texts[i][1]) for i in order]


def pair_prompts(pair, n: int, split: str = "heldout", seed: int = 0) -> list[list[int]]:
    """``n`` prompts for ``pair`` (a ``ModelPair``): chat-templated texts of ``split`` for a
    pair with a tokenizer ("heldout" for evaluation, "tune" for calibration and defaults,
    "train"), cycled; 24 random token ids each, from ``seed``, for a random pair."""
    if pair.tokenizer is not None:
        from treespark.models.chat import chat_ids

        texts = [p.text for p in (tuning_prompts() if split == "tune" else load_prompts(split))]
        return [chat_ids(pair.tokenizer, texts[i % len(texts)]) for i in range(n)]
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, pair.vocab_size, (24,), generator=g).tolist() for _ in range(n)]

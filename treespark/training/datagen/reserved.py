"""Held-out and tuning prompts are never drafter material: the normalised texts that no
generated request may equal (and that ``treespark.training.trainset`` looks for in stored
conversations)."""

from __future__ import annotations

from treespark.models.prompts import load_prompts, tuning_prompts


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def reserved_texts() -> frozenset[str]:
    """Heldout and tuning prompts, normalised: never a generated request."""
    return frozenset(normalise(p.text) for p in (*load_prompts("heldout"), *tuning_prompts()))


def assert_not_reserved(texts: list[str], reserved: frozenset[str]) -> None:
    bad = [t for t in texts if normalise(t) in reserved]
    if bad:
        raise AssertionError(f"generated requests equal heldout/tuning prompts: {bad[:3]!r}")

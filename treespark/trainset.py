"""The drafter's training set, rebuilt from the committed answer shards.

``treespark gen-data`` commits the target's answers as token ids (``data/answers``,
``treespark.datagen``). The drafter trains on the target's *features* of those
sequences (tapped hidden states, argmax labels, top-K log-probabilities), which are
large and cheap to recompute: one teacher-forced target pass per sequence
(``train.target_features``), cached per shard so that an interrupted build resumes.
Each cache file is named after its shard's content digest and the feature settings,
so a regenerated shard is never paired with stale features.

Held-out and tuning prompts must never reach training: ``leaked_prompts`` looks for
their text in every training conversation (``datagen.reserved`` already refuses them
as requests; this checks what was actually stored).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from treespark.datagen.reserved import normalise, reserved_texts
from treespark.datagen.shards import Sample, finished_shards, read_shard, shard_path
from treespark.train import Features, concat_features, target_features


def leaked_prompts(samples: Sequence[Sample], tokenizer, reserved: frozenset[str] | None = None) -> list[str]:
    """Reserved (held-out or tuning) prompt texts that occur in any sample's conversation
    (the tokens before its answer), normalised; empty when nothing leaked."""
    reserved = reserved_texts() if reserved is None else reserved
    found: set[str] = set()
    for s in samples:
        text = normalise(tokenizer.decode(s.tokens[: s.answer_start], skip_special_tokens=True))
        found.update(r for r in reserved if r in text)
    return sorted(found)


def shard_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def shard_features(target, tokenizer, answers_dir: Path, shard: int, cache_dir: Path, *,
                   tap_layers: tuple[int, ...], top_k: int, progress: bool = True) -> Features:
    """The target's features of one shard's samples (answers marked), cached in
    ``cache_dir``. Refuses a shard in which a reserved prompt appears."""
    path = shard_path(answers_dir, shard)
    taps = "-".join(map(str, tap_layers))
    cache = cache_dir / f"shard-{shard:05d}-{shard_digest(path)}-taps{taps}-top{top_k}.safetensors"
    if cache.exists():
        return Features.load(cache)
    samples, _ = read_shard(path)
    leaked = leaked_prompts(samples, tokenizer)
    if leaked:
        raise ValueError(f"shard {shard} holds held-out or tuning prompts: {leaked[:3]!r}")
    feats = target_features(target, tap_layers, [s.tokens for s in samples],
                            answer_starts=[s.answer_start for s in samples], top_k=top_k,
                            progress=progress, total=len(samples))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    feats.save(tmp)
    tmp.replace(cache)
    return feats


def answer_features(target, tokenizer, answers_dir: Path, cache_dir: Path, *, shards: int | None,
                    tap_layers: tuple[int, ...], top_k: int, progress: bool = True) -> tuple[Features, list[int]]:
    """Features of the first ``shards`` committed shards (all if None), and their indices."""
    done = finished_shards(Path(answers_dir))
    use = done[:shards] if shards is not None else done
    if not use:
        raise ValueError(f"no answer shards in {answers_dir}: run `treespark gen-data` first")
    parts = [shard_features(target, tokenizer, Path(answers_dir), i, Path(cache_dir), tap_layers=tap_layers,
                            top_k=top_k, progress=progress) for i in use]
    return concat_features(*parts), use

"""The drafter's training set, rebuilt from the committed answer shards.

``treespark gen-data`` commits the target's answers as token ids (``data/answers``,
``treespark.training.datagen``). The drafter trains on the target's *features* of those
sequences (tapped hidden states, argmax labels, top-K log-probabilities), which are
large and cheap to recompute: one teacher-forced target pass per sequence
(``train.target_features``), cached per shard so that an interrupted build resumes.
Each cache file is named after its shard's content digest and the feature settings,
so a regenerated shard is never paired with stale features. ``gen-data --work-dir``
writes that cache itself from the forwards that generated the shard
(``captured_features``), and then no second pass is needed.

Held-out and tuning prompts must never reach training: ``leaked_prompts`` looks for
their text in every training conversation (``datagen.reserved`` already refuses them
as requests; this checks what was actually stored).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from treespark.training.datagen.reserved import normalise, reserved_texts
from treespark.training.datagen.shards import (
    Capture,
    Sample,
    finished_shards,
    read_shard,
    shard_path,
)
from treespark.training.train import Features, concat_features, target_features


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


def feature_cache(answers_dir: Path, shard: int, cache_dir: Path, *, tap_layers: tuple[int, ...],
                  top_k: int) -> Path:
    """Where the features of committed shard ``shard`` are cached: named after its content
    digest and the feature settings."""
    path = shard_path(answers_dir, shard)
    taps = "-".join(map(str, tap_layers))
    return cache_dir / f"shard-{shard:05d}-{shard_digest(path)}-taps{taps}-top{top_k}.safetensors"


def save_features(feats: Features, path: Path) -> None:
    """Write atomically (a temp file, then a rename): a killed run leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    feats.save(tmp)
    tmp.replace(path)


def captured_features(samples: Sequence[Sample], captures: Sequence[Capture]) -> Features:
    """Training features from what the generating forwards computed (``make_shard_captured``)
    instead of a second pass: the same as ``target_features`` where training reads them
    (taps before the last position, labels and top-K at answer positions but the last).
    Where no forward produced them they are placeholders training never reads: labels -1
    and top-K ids -1 (log-probs -inf) at prompt positions and the last one, and the last
    position's taps 0 (anchors stop ``block_size`` tokens before a sequence's end)."""
    if len(samples) != len(captures) or not samples:
        raise ValueError(f"{len(samples)} samples and {len(captures)} captures: one each, at least one")
    toks, taps, labels, top_ids, top_lp, starts = [], [], [], [], [], [0]
    for s, c in zip(samples, captures, strict=True):
        n, a = len(s.tokens), s.answer_start
        width, k = c.taps.shape[1], c.top_ids.shape[1]
        if k < 1 or c.taps.shape[0] < n - 1 or c.top_ids.shape[0] != n - a:
            raise ValueError(f"a capture of {c.taps.shape[0]} positions and {c.top_ids.shape[0]} answer tokens "
                             f"(top {k}) does not cover a sample of {n} tokens, answer from {a}")
        toks.append(torch.tensor(s.tokens))
        taps.append(torch.cat([c.taps[: n - 1], torch.zeros(1, width, dtype=c.taps.dtype)]))
        # answer token j was chosen at position a - 1 + j
        ids = torch.full((n, k), -1, dtype=torch.int32)
        lp = torch.full((n, k), float("-inf"), dtype=torch.float16)
        ids[a - 1: n - 1], lp[a - 1: n - 1] = c.top_ids, c.top_logprobs
        top_ids.append(ids)
        top_lp.append(lp)
        labels.append(ids[:, 0].long())
        starts.append(starts[-1] + n)
    return Features(torch.cat(toks), torch.cat(taps), torch.cat(labels), torch.tensor(starts),
                    torch.tensor([s.answer_start for s in samples]), torch.cat(top_ids), torch.cat(top_lp))


def shard_features(target, tokenizer, answers_dir: Path, shard: int, cache_dir: Path, *,
                   tap_layers: tuple[int, ...], top_k: int, progress: bool = True) -> Features:
    """The target's features of one shard's samples (answers marked), cached in
    ``cache_dir``. Refuses a shard in which a reserved prompt appears."""
    path = shard_path(answers_dir, shard)
    cache = feature_cache(answers_dir, shard, cache_dir, tap_layers=tap_layers, top_k=top_k)
    if cache.exists():
        return Features.load(cache)
    samples, _ = read_shard(path)
    leaked = leaked_prompts(samples, tokenizer)
    if leaked:
        raise ValueError(f"shard {shard} holds held-out or tuning prompts: {leaked[:3]!r}")
    feats = target_features(target, tap_layers, [s.tokens for s in samples],
                            answer_starts=[s.answer_start for s in samples], top_k=top_k,
                            progress=progress, total=len(samples))
    save_features(feats, cache)
    return feats


def answer_features(target, tokenizer, answers_dirs: Sequence[str | Path], cache_dir: Path, *,
                    shards: int | None, tap_layers: tuple[int, ...], top_k: int, first_shard: int = 0,
                    progress: bool = True) -> tuple[Features, dict[str, list[int]]]:
    """Features of the committed shards ``first_shard`` up to ``shards`` (the end if None)
    of each folder in ``answers_dirs``, in that order, and the shard indices used per
    folder. Every folder
    is checked before any features are computed. Shards of different folders share
    ``cache_dir``: their cache names carry their content digest."""
    if not answers_dirs:
        raise ValueError("no answer folders given")
    if first_shard < 0:
        raise ValueError(f"first_shard must be >= 0, got {first_shard}")
    used: dict[str, list[int]] = {}
    for answers_dir in map(Path, answers_dirs):
        if str(answers_dir) in used:
            raise ValueError(f"answer folder {answers_dir} given twice")
        done = finished_shards(answers_dir)
        used[str(answers_dir)] = done[first_shard:shards]
        if not done:
            raise ValueError(f"no answer shards in {answers_dir}: run `treespark gen-data` first")
        if not used[str(answers_dir)]:
            raise ValueError(f"no answer shards in {answers_dir} from shard {first_shard} to {shards}: "
                             f"it has {len(done)}")
    parts = [shard_features(target, tokenizer, Path(d), i, Path(cache_dir), tap_layers=tap_layers, top_k=top_k,
                            progress=progress) for d, use in used.items() for i in use]
    return concat_features(*parts), used

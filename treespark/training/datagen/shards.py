"""Committed shards of samples: ``data/answers/shard-NNNNN.npz`` (token ids as uint16,
no pickles) and ``manifest.json``. Writes are atomic (temp file, fsync, rename), so a
killed run leaves only whole shards; the format is described in docs/drafter-data.md."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

SHARD_RE = re.compile(r"^shard-(\d{5})\.npz$")

# sample kinds, stored per sequence
KIND_WRITE_QUESTION = 0  # "write a question about X" -> the target's question
KIND_SELF = 1            # a target-written question -> its answer
KIND_DOC = 2             # a request built from documentation text -> its answer
KIND_CODE = 3            # a request about a stdlib function's source -> its answer
KIND_FOLLOWUP = 4        # first turn, answer, follow-up -> the second answer
KIND_CHAT = 5            # a templated chat request shaped like the held-out chat prompts -> its answer


@dataclass(frozen=True)
class Sample:
    tokens: list[int]     # conversation + answer
    answer_start: int     # tokens[answer_start:] is the target's answer
    kind: int
    temperature: float

    def __post_init__(self) -> None:
        if not 0 < self.answer_start < len(self.tokens):
            raise ValueError("a sample needs a non-empty context and a non-empty answer")


def shard_path(out_dir: Path, shard: int) -> Path:
    return out_dir / f"shard-{shard:05d}.npz"


def write_shard(path: Path, samples: list[Sample], meta: dict) -> None:
    """Write ``samples`` atomically: a temp file in the same folder, fsync, rename."""
    tokens = np.fromiter((t for s in samples for t in s.tokens), dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise ValueError("token ids must fit in uint16")
    offsets = np.cumsum([0] + [len(s.tokens) for s in samples]).astype(np.int32)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f, tokens=tokens.astype(np.uint16), offsets=offsets,
            answer_start=np.array([s.answer_start for s in samples], dtype=np.int32),
            kind=np.array([s.kind for s in samples], dtype=np.uint8),
            temperature=np.array([s.temperature for s in samples], dtype=np.float32),
            meta=np.array(json.dumps(meta, sort_keys=True)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[list[Sample], dict]:
    with np.load(path, allow_pickle=False) as z:
        tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
        samples = [Sample(tokens[offsets[i]:offsets[i + 1]].tolist(), int(a), int(k), round(float(t), 4))
                   for i, (a, k, t) in enumerate(zip(z["answer_start"], z["kind"], z["temperature"], strict=True))]
        return samples, json.loads(str(z["meta"]))


def shard_meta(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["meta"]))


def finished_shards(out_dir: Path) -> list[int]:
    if not out_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in out_dir.iterdir() if (m := SHARD_RE.match(p.name)))


def load_answers(out_dir: str | Path) -> tuple[list[list[int]], list[int]]:
    """Every committed shard's sequences and where each one's answer begins."""
    sequences: list[list[int]] = []
    starts: list[int] = []
    for i in finished_shards(Path(out_dir)):
        samples, _ = read_shard(shard_path(Path(out_dir), i))
        sequences += [s.tokens for s in samples]
        starts += [s.answer_start for s in samples]
    return sequences, starts


def write_manifest(out_dir: Path) -> dict:
    """``manifest.json``: rebuilt from the shards' own metadata (atomically)."""
    shards = [shard_meta(shard_path(out_dir, i)) for i in finished_shards(out_dir)]
    manifest = {
        "shards": len(shards),
        "sequences": sum(m["sequences"] for m in shards),
        "tokens": sum(m["tokens"] for m in shards),
        "answer_tokens": sum(m["answer_tokens"] for m in shards),
        "configs": sorted({json.dumps(m["config"], sort_keys=True) for m in shards}),
        "per_shard": [{k: m[k] for k in ("shard", "sequences", "tokens", "answer_tokens", "sources")}
                      for m in shards],
    }
    manifest["configs"] = [json.loads(c) for c in manifest["configs"]]
    tmp = out_dir / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out_dir / "manifest.json")
    return manifest


@dataclass(frozen=True)
class Capture:
    """What the forwards that generated one sample computed for the drafter."""

    taps: torch.Tensor          # [>= len(tokens) - 1, n_taps * hidden] float16: every position but the last
    top_ids: torch.Tensor       # [answer tokens, k] int32: the target's k likeliest tokens where each
    top_logprobs: torch.Tensor  # [answer tokens, k] float16  answer token was chosen, and their log-probs

    def cut(self, answer_tokens: int) -> Capture:
        """The capture of the answer's first ``answer_tokens`` tokens."""
        return Capture(self.taps, self.top_ids[:answer_tokens], self.top_logprobs[:answer_tokens])

"""The training set from committed answer shards: features per shard, cached, and no
held-out or tuning prompt let through."""

from __future__ import annotations

from pathlib import Path

import pytest

from treespark import random_pair
from treespark.training import trainset
from treespark.training.datagen.shards import KIND_DOC, KIND_SELF, Sample, shard_path, write_shard
from treespark.training.trainset import answer_features, leaked_prompts


class CharTokenizer:
    """Ids 4.. are characters; 1-3 are specials (end of turn, user, assistant)."""

    chars = "abcdefghijklmnopqrstuvwxyz ?:"

    def encode(self, text: str) -> list[int]:
        return [{"\x01": 1, "\x02": 2, "\x03": 3}.get(c) or 4 + self.chars.index(c.lower()) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.chars[i - 4] if i >= 4 else ("" if skip_special_tokens else "|") for i in ids)


def shard(tmp_path: Path, index: int, samples: list[Sample]) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_shard(shard_path(tmp_path, index), samples, {"shard": index})


def test_shards_become_cached_features_with_answer_starts(tmp_path: Path):
    pair = random_pair(64, 0)
    tok = CharTokenizer()
    a = Sample(tok.encode("\x02owls?\x01\x03") + list(range(10, 30)), 8, KIND_SELF, 0.0)
    b = Sample(tok.encode("\x02tea\x01\x03") + list(range(30, 50)), 6, KIND_DOC, 0.7)
    shard(tmp_path / "answers", 0, [a, b])
    shard(tmp_path / "answers", 1, [b])
    feats, used = answer_features(pair.target, tok, [tmp_path / "answers"], tmp_path / "cache", shards=1,
                                  tap_layers=(0, 2), top_k=4, progress=False)
    assert used == {str(tmp_path / "answers"): [0]} and len(feats) == 2 and feats.answer_start.tolist() == [8, 6]
    assert feats.tokens.tolist() == a.tokens + b.tokens
    cached = list((tmp_path / "cache").glob("shard-00000-*-taps0-2-top4.safetensors"))
    assert len(cached) == 1
    again, _ = answer_features(pair.target, tok, [tmp_path / "answers"], tmp_path / "cache", shards=1,
                               tap_layers=(0, 2), top_k=4, progress=False)
    assert again.taps.equal(feats.taps)
    both, used = answer_features(pair.target, tok, [tmp_path / "answers"], tmp_path / "cache", shards=None,
                                 tap_layers=(0, 2), top_k=4, progress=False)
    assert used == {str(tmp_path / "answers"): [0, 1]} and len(both) == 3


def test_several_answer_folders_are_concatenated_in_order(tmp_path: Path):
    pair = random_pair(64, 0)
    tok = CharTokenizer()
    a = Sample(tok.encode("\x02owls?\x01\x03") + list(range(10, 30)), 8, KIND_SELF, 0.0)
    b = Sample(tok.encode("\x02tea\x01\x03") + list(range(30, 50)), 6, KIND_DOC, 0.7)
    c = Sample(tok.encode("\x02rain\x01\x03") + list(range(50, 60)), 7, KIND_SELF, 1.0)
    shard(tmp_path / "greedy", 0, [a])
    shard(tmp_path / "greedy", 1, [b])
    shard(tmp_path / "sampled", 0, [c])     # the same index as greedy's first shard, other content
    dirs = [tmp_path / "sampled", tmp_path / "greedy"]
    feats, used = answer_features(pair.target, tok, dirs, tmp_path / "cache", shards=None,
                                  tap_layers=(0, 2), top_k=4, progress=False)
    assert used == {str(tmp_path / "sampled"): [0], str(tmp_path / "greedy"): [0, 1]}
    assert feats.tokens.tolist() == c.tokens + a.tokens + b.tokens
    assert feats.answer_start.tolist() == [7, 8, 6]
    assert len(list((tmp_path / "cache").glob("shard-00000-*"))) == 2   # one cache file per content
    # --shards counts in each folder
    first, used = answer_features(pair.target, tok, dirs, tmp_path / "cache", shards=1,
                                  tap_layers=(0, 2), top_k=4, progress=False)
    assert used == {str(tmp_path / "sampled"): [0], str(tmp_path / "greedy"): [0]}
    assert first.tokens.tolist() == c.tokens + a.tokens
    # --first-shard skips the shards before it in each folder (a continuation on new shards)
    rest, used = answer_features(pair.target, tok, [tmp_path / "greedy"], tmp_path / "cache", shards=None,
                                 first_shard=1, tap_layers=(0, 2), top_k=4, progress=False)
    assert used == {str(tmp_path / "greedy"): [1]} and rest.tokens.tolist() == b.tokens
    with pytest.raises(ValueError, match="from shard 1 to None: it has 1"):
        answer_features(pair.target, tok, dirs, tmp_path / "fresh", shards=None, first_shard=1,
                        tap_layers=(0, 2), top_k=4, progress=False)
    # a bad folder list is refused before any features are computed
    with pytest.raises(ValueError, match="given twice"):
        answer_features(pair.target, tok, [tmp_path / "greedy", tmp_path / "greedy"], tmp_path / "fresh",
                        shards=None, tap_layers=(0, 2), top_k=4, progress=False)
    with pytest.raises(ValueError, match="no answer shards in"):
        answer_features(pair.target, tok, [tmp_path / "greedy", tmp_path / "empty"], tmp_path / "fresh",
                        shards=None, tap_layers=(0, 2), top_k=4, progress=False)
    assert not (tmp_path / "fresh").exists()


def test_a_reserved_prompt_in_a_conversation_is_refused(tmp_path: Path, monkeypatch):
    tok = CharTokenizer()
    reserved = frozenset({"why do owls hoot?"})
    clean = Sample(tok.encode("\x02owls?\x01\x03") + [10, 11], 8, KIND_SELF, 0.0)
    leaked = Sample(tok.encode("\x02tell me: why do  Owls hoot?\x01\x03") + [10, 11], 30, KIND_SELF, 0.0)
    assert leaked_prompts([clean], tok, reserved) == []
    assert leaked_prompts([clean, leaked], tok, reserved) == ["why do owls hoot?"]
    # a shard holding a reserved prompt is not featurised
    monkeypatch.setattr(trainset, "reserved_texts", lambda: reserved)
    shard(tmp_path, 0, [clean, leaked])
    with pytest.raises(ValueError, match="held-out or tuning"):
        answer_features(random_pair(64, 0).target, tok, [tmp_path], tmp_path / "cache", shards=None,
                        tap_layers=(0, 2), top_k=0, progress=False)


def test_train_drafter_takes_several_answer_folders():
    from treespark.cli import build_parser

    args = build_parser().parse_args(["train-drafter", "--out", "D", "--from-answers", "data/answers-chat",
                                      "data/answers-chat-sampled", "--shards", "3"])
    assert args.from_answers == ["data/answers-chat", "data/answers-chat-sampled"] and args.shards == 3
    assert args.first_shard == 0
    args = build_parser().parse_args(["train-drafter", "--out", "D", "--from-answers", "data/answers-chat",
                                      "--first-shard", "47"])
    assert args.first_shard == 47 and args.shards is None

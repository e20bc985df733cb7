"""Drafter training data: repetition cut, shards on disk, resume, determinism, no heldout."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from treespark import ModelPair, random_pair
from treespark.models.prompts import load_prompts, tuning_prompts
from treespark.training.datagen.config import GenConfig
from treespark.training.datagen.generate import (
    Capture,
    cut_repetition,
    generate_shards,
    is_degenerate,
    make_shard,
    make_shard_captured,
)
from treespark.training.datagen.reserved import assert_not_reserved, normalise, reserved_texts
from treespark.training.datagen.shards import (
    KIND_CHAT,
    KIND_DOC,
    KIND_FOLLOWUP,
    KIND_SELF,
    KIND_WRITE_QUESTION,
    Sample,
    finished_shards,
    load_answers,
    read_shard,
    shard_meta,
    shard_path,
    write_shard,
)
from treespark.training.datagen.sources import (
    CHAT_TEMPLATES,
    CODE_TEMPLATES,
    Sources,
    chat_subjects,
    clean_question,
    default_sources,
    plan_shard,
)


class CharTokenizer:
    """A tiny character tokenizer with a chat template, for a 64-token random pair."""

    eos_token_id = 1
    chars = "abcde fghij klmno pqrst uvwxy z?.,\n" + "ABCDEFGHIJKLMNOPQRSTUVW:"  # ids 4..

    def __init__(self) -> None:
        assert 4 + len(self.chars) <= 64
        self.index = {c: i + 4 for i, c in reversed(list(enumerate(self.chars)))}

    specials = {"\x01": 1, "\x02": 2, "\x03": 3}  # how the chat template writes <eos>, <user>, <assistant>

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.specials.get(c) or self.index.get(c, self.index[" "]) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        special = {1: "<eos>", 2: "<user>", 3: "<assistant>"}
        out = []
        for i in ids:
            if i in special:
                out.append("" if skip_special_tokens else special[i])
            elif i >= 4 and i - 4 < len(self.chars):
                out.append(self.chars[i - 4])
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        text = "".join(("\x02" if m["role"] == "user" else "\x03") + m["content"][:40] + "\x01"
                       for m in messages) + "\x03"
        return self.encode(text) if tokenize else text


SOURCES = Sources(
    subjects=("rivers", "owls", "tea"),
    words=("socket", "archive"),
    docs=("Return the sum of a list.\n\nThe list may be empty.", "A paragraph about sets.\n\nAnother one."),
    snippets=("def f(x):\n    return x + 1", "def g(a, b):\n    return a * b"),
)
CFG = GenConfig(conversations=6, batch_size=4, max_answer_tokens=12, max_question_tokens=10,
                   max_prompt_tokens=48, max_context=96, followup_fraction=0.5, min_answer_tokens=2)


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    p = random_pair(64, 0)
    return ModelPair(p.target, p.drafter, CharTokenizer(), name="random-chars")


# -- the pure parts --------------------------------------------------------------------

def test_cut_repetition_keeps_two_rounds_of_a_loop():
    loop = [5, 6, 7, 8, 9, 10, 11, 12]
    tokens = [1, 2, 3] + loop * 5 + [99]
    assert cut_repetition(tokens, n=8, repeats=3) == [1, 2, 3] + loop * 2


def test_cut_repetition_leaves_unrepeated_text_and_short_ngrams():
    tokens = list(range(40))
    assert cut_repetition(tokens) == tokens
    short = [1, 2, 3, 4] * 6 + list(range(10, 30))  # period 4: its first 8-gram recurs at 4 and 8
    assert cut_repetition(short, n=8, repeats=3) == short[:8]
    assert cut_repetition([7] * 30, n=8, repeats=3) == [7] * 2
    twice = [1, 2, 3] + list(range(50, 58)) * 2 + [4, 5]  # two rounds are not a loop yet
    assert cut_repetition(twice, n=8, repeats=3) == twice


def test_degenerate_answers_are_detected():
    assert is_degenerate([], "", 1)
    assert is_degenerate([5, 6], "  ", 1)
    assert is_degenerate([5] * 45 + [6], "xx", 4)
    assert not is_degenerate(list(range(50)), "fine text", 4)


def test_clean_question():
    reserved = reserved_texts()
    assert clean_question('Question: "How do owls see at night?"\nMore text', reserved) == \
        "How do owls see at night?"
    assert clean_question("Hi", reserved) is None
    assert clean_question("A curious AI on a journey to Khan Academy.", reserved) is None
    assert clean_question("Sure, here is one:\n\nExplain how a socket accepts a connection.", reserved) == \
        "Explain how a socket accepts a connection."
    held = load_prompts("heldout")[0].text
    assert clean_question(held.upper(), reserved) is None


def test_reserved_prompts_are_refused():
    reserved = reserved_texts()
    held, tune = load_prompts("heldout")[0].text, tuning_prompts()[0].text
    assert normalise(held) in reserved and normalise(tune) in reserved
    with pytest.raises(AssertionError):
        assert_not_reserved(["fine", "  " + held + " "], reserved)
    # a source whose request would equal a heldout prompt is never planned
    trap = replace(SOURCES, snippets=("x",))
    plans = plan_shard(replace(CFG, conversations=50, mix=(0, 0, 1)), trap, 0, frozenset(
        {normalise(CODE_TEMPLATES[0].format(x="x"))}))
    assert len(plans) == 50
    assert all(p.text != CODE_TEMPLATES[0].format(x="x") for p in plans)


def test_default_sources_avoid_heldout_and_tuning_prompts():
    src = default_sources()
    assert len(src.docs) > 1000 and len(src.snippets) > 500 and len(src.words) > 300
    assert {"socket", "archive", "connection"} <= set(src.words) and "twice" not in src.words
    reserved = reserved_texts()
    plans = [p for s in range(20) for p in plan_shard(GenConfig(), src, s, reserved)]
    assert_not_reserved([p.text for p in plans], reserved)
    held = [p.text for p in load_prompts("heldout")]
    assert not any(h in d for d in src.docs for h in held)
    # distinct requests (the question-writing ones repeat across shards; the questions they
    # yield are sampled, so they do not)
    pasted = [p.text for p in plans if p.kind != KIND_SELF]
    assert len(set(pasted)) > 0.9 * len(pasted)
    asks = [p.text for p in plans if p.kind == KIND_SELF]
    assert len(set(asks)) > 0.5 * len(asks)


def test_plan_is_a_function_of_config_and_shard():
    r = reserved_texts()
    assert plan_shard(CFG, SOURCES, 3, r) == plan_shard(CFG, SOURCES, 3, r)
    assert plan_shard(CFG, SOURCES, 3, r) != plan_shard(CFG, SOURCES, 4, r)
    assert plan_shard(CFG, SOURCES, 3, r) != plan_shard(replace(CFG, seed=1), SOURCES, 3, r)


def test_the_committed_shards_are_of_the_default_config():
    """A fourth request source must not change what answers-1 plans, or its digest."""
    committed = Path(__file__).resolve().parents[2] / "data" / "answers"
    assert shard_meta(shard_path(committed, 0))["config_digest"] == GenConfig().digest()
    with pytest.raises(ValueError, match="three or four"):
        GenConfig(mix=(1.0, 1.0))
    with pytest.raises(ValueError, match="three or four"):
        GenConfig(mix=(0.0, 0.0, 0.0, 0.0))


def test_chat_subjects_never_restate_a_reserved_prompt():
    reserved = reserved_texts()
    # held-out prompts ask about black holes and the water cycle; none about owls or tea
    assert chat_subjects(("black holes", "owls", "the water cycle", "tea"), reserved) == ("owls", "tea")
    held = load_prompts("heldout")[0].text
    assert chat_subjects(("a heist",), frozenset({normalise(held)})) == ()


def test_chat_requests_are_planned_from_the_chat_templates():
    cfg = replace(CFG, conversations=40, mix=(0, 0, 0, 1), greedy_fraction=1.0)
    plans = plan_shard(cfg, SOURCES, 0, reserved_texts())
    assert len(plans) == 40 and {p.kind for p in plans} == {KIND_CHAT}
    assert {p.temperature for p in plans} == {0.0}
    made = {t.format(x=x) for t in CHAT_TEMPLATES for x in (*SOURCES.subjects, *SOURCES.words)}
    assert {p.text for p in plans} <= made
    # answers-1's three sources never plan one
    assert KIND_CHAT not in {p.kind for p in plan_shard(replace(CFG, conversations=40), SOURCES, 0, reserved_texts())}
    with pytest.raises(ValueError, match="share nothing"):
        plan_shard(cfg, replace(SOURCES, words=("archive",)), 0, frozenset({"what is an archive?"}))


def test_default_chat_requests_avoid_the_reserved_prompts_and_are_distinct():
    reserved = reserved_texts()
    cfg = replace(GenConfig(), mix=(0, 0, 0, 1))
    plans = [p for s in range(5) for p in plan_shard(cfg, default_sources(), s, reserved)]
    assert_not_reserved([p.text for p in plans], reserved)
    assert len({p.text for p in plans}) > 0.9 * len(plans)
    assert not any(" black hole" in p.text or "water cycle" in p.text for p in plans)


def test_chat_ids_formats_multi_turn_with_the_same_function():
    from treespark.models.chat import chat_ids

    tok = CharTokenizer()
    one = chat_ids(tok, "hi there")
    two = chat_ids(tok, [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo"},
                         {"role": "user", "content": "more"}])
    assert one == chat_ids(tok, [{"role": "user", "content": "hi there"}])
    assert two[: len(one) - 1] == one[:-1] and len(two) > len(one)


# -- shards ----------------------------------------------------------------------------

def test_shard_round_trip(tmp_path: Path):
    samples = [Sample([1, 2, 3, 65535, 7], 3, KIND_DOC, 0.0),
               Sample([9, 8], 1, KIND_FOLLOWUP, 0.7)]
    path = tmp_path / "shard-00000.npz"
    write_shard(path, samples, {"x": 1})
    back, meta = read_shard(path)
    assert back == samples
    assert meta == {"x": 1}
    with np.load(path) as z:
        assert z["tokens"].dtype == np.uint16 and z["offsets"].dtype == np.int32
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(ValueError):
        write_shard(tmp_path / "shard-00001.npz", [Sample([70000, 1], 1, 0, 0.0)], {})


def test_generated_shard_is_well_formed_and_deterministic(pair, tmp_path: Path):
    a = make_shard(pair, CFG, SOURCES, 1)
    b = make_shard(pair, CFG, SOURCES, 1)
    assert a == b
    assert a != make_shard(pair, CFG, SOURCES, 2)
    kinds = {s.kind for s in a}
    assert KIND_FOLLOWUP in kinds or KIND_WRITE_QUESTION in kinds
    for s in a:
        answer = s.tokens[s.answer_start:]
        assert 1 <= len(answer) <= CFG.max_answer_tokens
        assert cut_repetition(answer, CFG.ngram, CFG.ngram_repeats) == answer
        assert s.tokens[s.answer_start - 1] == 3  # the answer follows the assistant marker
    temps = {s.temperature for s in a}
    assert 0.0 in temps and temps - {0.0}
    chat = make_shard(pair, replace(CFG, mix=(0, 0, 0, 1), greedy_fraction=1.0, followup_fraction=0.0), SOURCES, 1)
    assert chat and {s.kind for s in chat} == {KIND_CHAT} and {s.temperature for s in chat} == {0.0}


def test_captured_features_equal_a_second_pass_where_training_reads_them(pair, tmp_path: Path, monkeypatch):
    """``make_shard_captured`` gives ``make_shard``'s samples, and features from the
    generating forwards equal to ``target_features`` over the stored tokens at every
    position training reads; ``generate_shards(features_dir=...)`` caches them where
    ``shard_features`` looks, so training runs no second pass over a new shard."""
    import torch

    from treespark.training import trainset
    from treespark.training.train import draft_vocabulary, target_features

    cfg = replace(CFG, ngram=1, ngram_repeats=2)   # a repeated token cuts an answer, and its capture
    samples, feats = make_shard_captured(pair, cfg, SOURCES, 1, top_k=4)
    assert samples == make_shard(pair, cfg, SOURCES, 1)
    layers = tuple(pair.drafter.config.target_layer_ids)
    ref = target_features(pair.target, layers, [s.tokens for s in samples],
                          answer_starts=[s.answer_start for s in samples], top_k=4, progress=False)
    for name in ("tokens", "starts", "answer_start"):
        assert getattr(feats, name).equal(getattr(ref, name)), name
    for i, s in enumerate(samples):
        lo, hi = int(ref.starts[i]), int(ref.starts[i + 1])
        ans = slice(lo + s.answer_start - 1, hi - 1)        # where each answer token was chosen
        torch.testing.assert_close(feats.taps[lo:hi - 1].float(), ref.taps[lo:hi - 1].float(), atol=2e-3, rtol=2e-3)
        assert feats.labels[ans].equal(ref.labels[ans])
        assert feats.top_ids[ans].equal(ref.top_ids[ans])
        torch.testing.assert_close(feats.top_logprobs[ans].float(), ref.top_logprobs[ans].float(), atol=1e-2, rtol=0)
        assert int(feats.labels[hi - 1]) == -1 and bool((feats.labels[lo:lo + s.answer_start - 1] == -1).all())
    # the placeholders never count toward the draft vocabulary
    assert draft_vocabulary(feats.labels, 8, 64).equal(draft_vocabulary(ref.labels[feats.labels >= 0], 8, 64))

    out, work = tmp_path / "answers", tmp_path / "work"
    assert generate_shards(pair, cfg, SOURCES, out, max_shards=1, features_dir=work, top_k=4, progress=False) == [0]

    def second_pass(*args, **kwargs):
        raise AssertionError("a second pass over a captured shard")

    monkeypatch.setattr(trainset, "target_features", second_pass)
    cached = trainset.shard_features(pair.target, pair.tokenizer, out, 0, work, tap_layers=layers, top_k=4,
                                     progress=False)
    assert cached.tokens.tolist() == [t for s in read_shard(shard_path(out, 0))[0] for t in s.tokens]


def test_captured_features_refuse_a_capture_that_does_not_cover_its_sample():
    import torch

    from treespark.training.trainset import captured_features

    s = Sample([5, 6, 3, 7, 8, 9], 3, KIND_CHAT, 0.0)
    ok = Capture(torch.ones(7, 2, dtype=torch.float16), torch.zeros(3, 2, dtype=torch.int32),
                 torch.zeros(3, 2, dtype=torch.float16))
    f = captured_features([s], [ok])            # a capture longer than the sample (a cut answer) is cut
    assert f.taps.shape == (6, 2) and f.taps[-1].abs().sum() == 0 and f.labels.tolist() == [-1, -1, 0, 0, 0, -1]
    with pytest.raises(ValueError, match="does not cover"):
        captured_features([s], [Capture(ok.taps[:4], ok.top_ids, ok.top_logprobs)])
    with pytest.raises(ValueError, match="does not cover"):
        captured_features([s], [Capture(ok.taps, ok.top_ids[:2], ok.top_logprobs[:2])])
    with pytest.raises(ValueError, match="one each"):
        captured_features([s, s], [ok])


def test_resume_writes_only_missing_shards(pair, tmp_path: Path, monkeypatch):
    out = tmp_path / "answers"
    assert generate_shards(pair, CFG, SOURCES, out, max_shards=1, progress=False) == [0]
    s0 = shard_path(out, 0)
    bytes0, mtime0 = s0.read_bytes(), s0.stat().st_mtime_ns

    # killed while renaming shard 1: nothing of it is committed
    real_replace = os.replace

    def crash(src, dst):
        if str(dst).endswith("shard-00001.npz"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        generate_shards(pair, CFG, SOURCES, out, max_shards=2, progress=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert finished_shards(out) == [0]

    assert generate_shards(pair, CFG, SOURCES, out, max_shards=2, progress=False) == [1]
    assert s0.read_bytes() == bytes0 and s0.stat().st_mtime_ns == mtime0
    assert not list(out.glob(".shard-*"))
    assert read_shard(shard_path(out, 1))[0] == make_shard(pair, CFG, SOURCES, 1)

    seqs, starts = load_answers(out)
    expected = read_shard(s0)[0] + read_shard(shard_path(out, 1))[0]
    assert seqs == [s.tokens for s in expected] and starts == [s.answer_start for s in expected]
    manifest = (out / "manifest.json").read_text()
    assert '"shards": 2' in manifest

    # the token target stops the run; another config refuses to mix into the folder
    assert generate_shards(pair, CFG, SOURCES, out, target_tokens=1, progress=False) == []
    with pytest.raises(ValueError, match="another config"):
        generate_shards(pair, replace(CFG, seed=5), SOURCES, out, max_shards=3, progress=False)

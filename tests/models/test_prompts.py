"""Tests for treespark.models.prompts (the prompt set) and treespark.training.corpus (offline text)."""

from __future__ import annotations

import pytest

from treespark.models.prompts import KINDS, SPLITS, Prompt, load_prompts
from treespark.training.corpus import training_texts


def test_prompt_counts_and_balance():
    prompts = load_prompts()
    assert len(prompts) >= 120
    for kind in KINDS:
        n_kind = len(load_prompts(kind=kind))
        assert abs(n_kind - len(prompts) / 2) <= 0.05 * len(prompts)
        heldout = len(load_prompts(split="heldout", kind=kind))
        assert 0.20 <= heldout / n_kind <= 0.30  # about 25 %, stratified by kind


def test_ids_unique_and_splits_disjoint():
    prompts = load_prompts()
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids))
    train, heldout = load_prompts(split="train"), load_prompts(split="heldout")
    assert len(train) + len(heldout) == len(prompts)
    assert not {p.id for p in train} & {p.id for p in heldout}
    assert not {p.text for p in train} & {p.text for p in heldout}
    assert len({p.text for p in prompts}) == len(prompts)


def test_both_kinds_in_both_splits():
    for split in SPLITS:
        for kind in KINDS:
            got = load_prompts(split=split, kind=kind)
            assert got
            assert all(p.split == split and p.kind == kind for p in got)


def test_unknown_filters_and_bad_prompts_raise():
    with pytest.raises(ValueError, match="split"):
        load_prompts(split="test")
    with pytest.raises(ValueError, match="kind"):
        load_prompts(kind="poetry")
    with pytest.raises(ValueError):
        Prompt(id="x", kind="chat", split="dev", text="hi")
    with pytest.raises(ValueError):
        Prompt(id="x", kind="chat", split="train", text="  ")


def test_training_texts_large_deterministic_and_clean():
    texts = training_texts()
    assert sum(len(t) for t in texts) > 1_000_000
    assert texts == training_texts()
    assert len(texts) == len(set(texts))
    joined = "\n".join(texts)
    for p in load_prompts(split="heldout"):
        assert p.text not in joined, p.id
    train_texts = set(texts)
    assert all(p.text in train_texts for p in load_prompts(split="train"))


def test_training_texts_max_chars():
    texts = training_texts(max_chars=10_000)
    assert sum(len(t) for t in texts) == 10_000
    assert texts[:-1] == training_texts()[: len(texts) - 1]
    with pytest.raises(ValueError):
        training_texts(max_chars=-1)


def test_synthetic_prompts_are_deterministic_distinct_and_never_heldout():
    from treespark.models.prompts import synthetic_prompts

    a, b, c = synthetic_prompts(0), synthetic_prompts(0), synthetic_prompts(1)
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in c]          # the seed shuffles
    assert sorted(p.text for p in a) == sorted(p.text for p in c)
    texts = [p.text for p in a]
    assert len(texts) == len(set(texts)) >= 300
    heldout = {p.text for p in load_prompts(split="heldout")}
    assert not heldout & set(texts)
    assert {p.split for p in a} == {"train"} and {p.kind for p in a} == set(KINDS)


def test_tuning_prompts_are_disjoint_from_training_and_heldout():
    from treespark.models.prompts import synthetic_prompts, tuning_prompts

    tune = [p.text for p in tuning_prompts()]
    assert len(tune) == len(set(tune)) >= 60
    assert tune == [p.text for p in tuning_prompts()]  # deterministic
    seen = {p.text for p in synthetic_prompts()} | {p.text for p in load_prompts()}
    assert not seen & set(tune)


def test_varied_prompts_are_deterministic_distinct_and_never_heldout_or_tuning():
    from treespark.models.prompts import synthetic_prompts, tuning_prompts, varied_prompts

    a, b, c = varied_prompts(0), varied_prompts(0), varied_prompts(1)
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in c]
    texts = [p.text for p in a]
    assert len(texts) == len(set(texts)) >= 1500
    reserved = {p.text for p in load_prompts(split="heldout")} | {p.text for p in tuning_prompts()}
    assert not reserved & set(texts)
    assert not {p.text for p in synthetic_prompts()} & set(texts)  # a pool of its own
    assert {p.split for p in a} == {"train"} and {p.kind for p in a} == set(KINDS)
    assert all("{" not in p.text or "```" in p.text for p in a)  # every template filled

"""Drafter distillation: it learns, and a resumed run continues where it stopped."""

from __future__ import annotations

import torch

from treespark import Budget, generate, random_pair
from treespark.drafter import load_drafter
from treespark.train import TrainConfig, evaluate, target_features, train_drafter


def sequences(pair, n=12):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(0, pair.vocab_size, (6,), generator=g).tolist()
        out.append(prompt + generate(pair, prompt, max_new_tokens=40, temperature=1.0, seed=i,
                                     budget=Budget.off()).token_ids)
    return out


def test_training_improves_agreement_and_resumes(tmp_path):
    pair = random_pair(32, 3)
    feats = target_features(pair.target, pair.drafter.config.target_layer_ids, sequences(pair), progress=False)
    before = evaluate(pair.drafter, feats)
    cfg = TrainConfig(steps=60, lr=3e-3, anchors_per_step=16, warmup=5, save_every=30, log_every=30)
    half = TrainConfig(**{**cfg.__dict__, "steps": 30})
    train_drafter(pair.drafter, feats, half, tmp_path, progress=False)
    assert (tmp_path / "optimizer.safetensors").exists() and not list(tmp_path.glob("*.pt"))
    resumed = train_drafter(pair.drafter, feats, cfg, tmp_path, progress=False)
    assert resumed["history"][0]["step"] == 60          # continued from step 30, not from 0
    after = evaluate(pair.drafter, feats)
    assert after[0] > before[0] + 0.05
    assert load_drafter(tmp_path).config == pair.drafter.config


def test_draft_vocabulary_counts_weighted_labels():
    from treespark.train import draft_vocabulary

    labels = torch.tensor([5, 5, 5, 7, 9, 9])
    assert draft_vocabulary(labels, 2, 12).tolist() == [5, 9]
    # label 7 drawn ten times as often as the others outweighs both
    w = torch.tensor([1.0, 1, 1, 10, 1, 1], dtype=torch.float64)
    assert draft_vocabulary(labels, 1, 12, w).tolist() == [7]
    assert draft_vocabulary(labels, 2, 12, w).tolist() == [5, 7]


def test_target_answers_do_not_depend_on_the_batch_size():
    from treespark.recipe import target_answers

    pair = random_pair(32, 3)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, pair.vocab_size, (int(n),), generator=g).tolist() for n in (3, 7, 5, 9, 4)]
    one = target_answers(pair, prompts, 12, batch_size=1, progress=False)
    many = target_answers(pair, prompts, 12, batch_size=4, progress=False)
    assert one == many
    assert all(a[: len(p)] == p and len(a) == len(p) + 12 for a, p in zip(one, prompts, strict=True))

"""Drafter distillation: it learns, resumes where it stopped, and draws and weighs what
serving sees (answer anchors, early rows first, the target's soft labels)."""

from __future__ import annotations

import math

import torch

from treespark import Budget, generate, random_pair
from treespark.models.checkpoint import load_drafter
from treespark.training.judge import judge
from treespark.training.train import (
    SequenceDraws,
    TrainConfig,
    concat_features,
    row_weights,
    soft_losses,
    target_features,
    train_drafter,
)


def sequences(pair, n=12):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        prompt = torch.randint(0, pair.vocab_size, (6,), generator=g).tolist()
        out.append(prompt + generate(pair, prompt, max_new_tokens=40, temperature=1.0, seed=i,
                                     budget=Budget.off()).token_ids)
    return out


def test_training_with_soft_labels_improves_agreement_and_resumes(tmp_path):
    pair = random_pair(32, 3)
    feats = target_features(pair.target, pair.drafter.config.target_layer_ids, sequences(pair),
                            answer_starts=[6] * 12, top_k=8, progress=False)
    before = judge(pair.drafter, feats, max_tokens=40).agreement
    cfg = TrainConfig(steps=60, lr=3e-3, seqs_per_step=2, anchors_per_seq=8, warmup=5, save_every=30,
                      log_every=30, row_gamma=2.0, ce_weight=0.1, kl_weight=1.0, tv_weight=0.5)
    half = TrainConfig(**{**cfg.__dict__, "steps": 30})
    train_drafter(pair.drafter, feats, half, tmp_path, progress=False)
    assert (tmp_path / "optimizer.safetensors").exists() and not list(tmp_path.glob("*.pt"))
    resumed = train_drafter(pair.drafter, feats, cfg, tmp_path, progress=False)
    assert resumed["history"][0]["step"] == 60          # continued from step 30, not from 0
    after = judge(pair.drafter, feats, max_tokens=40).agreement
    assert after[0] > before[0] + 0.05
    assert load_drafter(tmp_path).config == pair.drafter.config


def test_features_keep_answer_starts_and_the_targets_top_k(tmp_path):
    pair = random_pair(32, 3)
    seqs = sequences(pair, 3)
    feats = target_features(pair.target, (0, 2), seqs, answer_starts=[6, 7, 8], top_k=5, progress=False)
    assert feats.answer_start.tolist() == [6, 7, 8]
    assert feats.top_ids.shape == (feats.tokens.numel(), 5)
    assert torch.equal(feats.top_ids[:, 0].long(), feats.labels)        # top-1 is the argmax label
    assert bool((feats.top_logprobs[:, :-1] >= feats.top_logprobs[:, 1:]).all())
    assert float(feats.top_logprobs.float().exp().sum(-1).max()) <= 1.0 + 1e-2
    feats.save(tmp_path / "f.safetensors")
    both = concat_features(feats, type(feats).load(tmp_path / "f.safetensors"))
    assert len(both) == 6 and both.answer_start.tolist() == [6, 7, 8] * 2
    assert both.head(3).tokens.numel() == feats.tokens.numel()


def test_anchors_fall_on_answers_and_sequences_are_drawn_without_replacement():
    pair = random_pair(32, 3)
    seqs = sequences(pair, 5)
    n = len(seqs[0])
    starts = [6, 20, 30, n - 5, n - 4]     # with block 4, the last one has no room for an anchor
    feats = target_features(pair.target, (0, 2), seqs, answer_starts=starts, progress=False)
    draws = SequenceDraws(feats, 4, None, torch.Generator().manual_seed(0))
    epoch = draws.next_sequences(4)
    assert sorted(epoch) == [0, 1, 2, 3]                # each eligible sequence once per epoch
    assert sorted(draws.next_sequences(4)) == [0, 1, 2, 3]
    for seq in range(4):
        a = draws.anchors(seq, 64)
        assert len(set(a.tolist())) == a.numel()         # distinct
        assert int(a.min()) >= starts[seq] and int(a.max()) + 4 <= n - 1
    assert draws.anchors(3, 8).tolist() == [n - 5]       # the one anchor whose rows all have labels


def test_row_weights_decay_with_the_offset_and_average_one():
    w = row_weights(6, 2.0)
    assert math.isclose(float(w.mean()), 1.0, rel_tol=1e-6)
    assert bool((w[1:] < w[:-1]).all())
    assert math.isclose(float(w[1] / w[0]), math.exp(-0.5), rel_tol=1e-6)
    assert torch.equal(row_weights(4, 0.0), torch.ones(4))


def test_soft_losses_against_the_targets_top_k():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g)
    logp = logits.log_softmax(-1)
    top = logp.topk(10, dim=-1)                          # K = V: p is known exactly
    ce, tv = soft_losses(logits, top.indices.int(), top.values, None)
    assert torch.allclose(tv, torch.zeros(3), atol=1e-5)               # q == p
    assert torch.allclose(ce, -(logp.exp() * logp).sum(-1), atol=1e-5)  # soft CE = entropy of p
    peaked = torch.full((3, 10), -30.0)
    peaked[:, 0] = 30.0
    _, tv_far = soft_losses(peaked, top.indices.int(), top.values, None)
    assert torch.allclose(tv_far, 1 - logp.exp()[:, 0], atol=1e-4)     # TV = 1 - p(token 0)
    # a draft vocabulary without token 9: its target mass counts, the drafter cannot match it
    t2d = torch.arange(10)
    t2d[9] = -1
    _, tv_cut = soft_losses(logits[:, :9], top.indices.int(), top.values, t2d)
    assert bool((tv_cut > 0).all())

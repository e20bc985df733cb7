"""The recipe that builds the default drafter, end to end and reproducibly.

``build_drafter(recipe, work_dir, out_dir)``:

1. sequences: the offline corpus (``treespark.training.corpus``) cut into fixed-length
   windows, plus the target's own answers (serving contexts look like these): greedy
   to the train-split prompts and to templated requests (``synthetic_prompts`` and the
   larger ``varied_prompts`` pool), and sampled to the train-split prompts; each set
   is cached on its own in ``work_dir``;
2. features: one teacher-forced target pass per sequence (tapped hidden states and
   the target's argmax labels), cached in ``work_dir``;
3. a reduced draft vocabulary: the most frequent target labels;
4. distillation (``treespark.training.train``), resumable from ``work_dir``;
5. held-out agreement per block row, written with the recipe beside the drafter.

``build_from_answers(recipe, ...)`` (``AnswersRecipe``, ``treespark train-drafter
--from-answers``) trains on the committed answer shards instead: features recomputed
from their token ids (``treespark.training.trainset``), anchors on answer positions only, soft
labels, and the judgement of ``treespark.training.judge`` before and after.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from treespark.engine.run import target_answers
from treespark.models.chat import chat_ids
from treespark.models.checkpoint import load_drafter, save_drafter
from treespark.models.drafter import grown
from treespark.models.pair import ModelPair
from treespark.models.prompts import load_prompts, synthetic_prompts, varied_prompts
from treespark.training import trainset
from treespark.training.corpus import training_texts
from treespark.training.judge import heldout_features, judge
from treespark.training.train import (
    Features,
    TrainConfig,
    concat_features,
    draft_vocabulary,
    new_drafter_for,
    target_features,
    train_drafter,
)


@dataclass(frozen=True)
class DrafterRecipe:
    seq_len: int = 256
    corpus_tokens: int = 160_000     # tokens of offline corpus text
    answer_tokens: int = 128         # answer length per train prompt
    synthetic_prompts: int = 330     # templated train requests answered greedily (prompts.synthetic_prompts)
    sampled_answer_sets: int = 2     # extra answer sets to the train prompts, sampled at ``sampled_temperature``
    sampled_temperature: float = 0.8
    varied_prompts: int = 1751       # requests from the larger templated pool (prompts.varied_prompts), answered greedily
    varied_answer_tokens: int = 96   # answer length for those
    varied_batch_size: int = 64      # rows per engine step while answering them (plain decoding)
    answer_weight: float = 3.0       # how much likelier an answer is drawn than a corpus window
    block_size: int = 6
    tap_layers: tuple[int, ...] = (2, 15, 28)
    markov_rank: int = 64
    draft_vocab: int = 8192
    mask_token_id: int = 3           # SmolLM2's <repo_name>: never seen in chat
    train: TrainConfig = TrainConfig(steps=12000, lr=1.5e-3, seqs_per_step=1, anchors_per_seq=48)
    seed: int = 0


def corpus_sequences(tokenizer, total_tokens: int, seq_len: int) -> list[list[int]]:
    ids: list[int] = []
    eos = tokenizer.eos_token_id or 0
    for text in training_texts():
        ids += tokenizer.encode(text) + [eos]
        if len(ids) >= total_tokens:
            break
    ids = ids[:total_tokens]
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def _cached(path: Path, make) -> Features:
    """Features cached in ``path``; ``make()`` builds them once (each set is kept on its
    own, so an interrupted build resumes where it stopped)."""
    if path.exists():
        return Features.load(path)
    feats = make()
    feats.save(path)
    return feats


def build_drafter(recipe: DrafterRecipe, target, tokenizer, work_dir: Path, out_dir: Path,
                  *, progress: bool = True) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # a throwaway drafter of the right shape lets the engine decode (budget off)
    tmp = new_drafter_for(target, block_size=recipe.block_size, tap_layers=recipe.tap_layers,
                          markov_rank=recipe.markov_rank, mask_token_id=recipe.mask_token_id,
                          d2t=None, seed=recipe.seed)
    pair = ModelPair(target, tmp, tokenizer)
    train_prompts = [chat_ids(tokenizer, p.text) for p in load_prompts("train")]
    held_prompts = [chat_ids(tokenizer, p.text) for p in load_prompts("heldout")]
    n = recipe.answer_tokens

    def answer_features(temperature: float, seed: int, prompts: list[list[int]], tokens: int = n,
                        batch_size: int = 16, starts: list[list[int]] | None = None):
        return lambda: target_features(
            target, recipe.tap_layers,
            target_answers(pair, prompts, tokens, temperature=temperature, seed=seed,
                           batch_size=batch_size, progress=progress),
            answer_starts=[len(p) for p in starts] if starts is not None else None, progress=progress)

    held_feats = _cached(work_dir / f"features_heldout_n{n}.safetensors", answer_features(0.0, 0, held_prompts,
                                                                                        starts=held_prompts))
    answer_sets = [_cached(work_dir / f"features_answers_greedy_n{n}.safetensors", answer_features(0.0, 0, train_prompts))]
    if recipe.synthetic_prompts:
        synth = [chat_ids(tokenizer, p.text) for p in synthetic_prompts(recipe.seed)[: recipe.synthetic_prompts]]
        answer_sets.append(_cached(work_dir / f"features_synthetic{len(synth)}_greedy_n{n}.safetensors",
                                   answer_features(0.0, 0, synth)))
    if recipe.varied_prompts:
        varied = [p.text for p in varied_prompts(recipe.seed)[: recipe.varied_prompts]]
        digest = hashlib.sha256("\0".join(varied).encode()).hexdigest()[:10]
        m = recipe.varied_answer_tokens
        answer_sets.append(_cached(
            work_dir / f"features_varied{len(varied)}_{digest}_greedy_n{m}.safetensors",
            answer_features(0.0, 0, [chat_ids(tokenizer, t) for t in varied], m, recipe.varied_batch_size)))
    for k in range(recipe.sampled_answer_sets):
        t = recipe.sampled_temperature
        answer_sets.append(_cached(work_dir / f"features_answers_t{t}_set{k}_n{n}.safetensors",
                                   answer_features(t, 1000 * (k + 1), train_prompts)))
    corpus_feats = _cached(
        work_dir / f"features_corpus_{recipe.corpus_tokens}_{recipe.seq_len}.safetensors",
        lambda: target_features(target, recipe.tap_layers,
                                corpus_sequences(tokenizer, recipe.corpus_tokens, recipe.seq_len),
                                progress=progress))
    answers_feats = concat_features(*answer_sets)
    feats = concat_features(answers_feats, corpus_feats)
    weights = torch.ones(len(feats), dtype=torch.float64)
    weights[: len(answers_feats)] = recipe.answer_weight
    # the draft vocabulary counts each label as often as training draws it
    label_weights = torch.repeat_interleave(weights, feats.starts[1:] - feats.starts[:-1])
    d2t = draft_vocabulary(feats.labels, recipe.draft_vocab, target.config.vocab_size, label_weights)
    coverage = float(torch.isin(held_feats.labels, d2t).float().mean())
    drafter = new_drafter_for(target, block_size=recipe.block_size, tap_layers=recipe.tap_layers,
                              markov_rank=recipe.markov_rank, mask_token_id=recipe.mask_token_id,
                              d2t=d2t, seed=recipe.seed)
    result = train_drafter(drafter, feats, recipe.train, work_dir / "checkpoint", target=target,
                           weights=weights, progress=progress)
    agreement = judge(drafter, held_feats, max_tokens=n).agreement
    save_drafter(drafter, out_dir)
    report = {
        "recipe": asdict(recipe),
        "train_tokens": int(feats.tokens.numel()),
        "train_sequences": len(feats),
        "answer_sequences": len(answers_feats),
        "heldout_tokens": int(held_feats.tokens.numel()),
        "draft_vocab_heldout_coverage": round(coverage, 4),
        "heldout_top1_agreement_by_offset": [round(a, 4) for a in agreement],
        "history": result["history"],
        "wall_s": round(time.time() - t0, 1),
    }
    (out_dir / "recipe.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@dataclass(frozen=True)
class AnswersRecipe:
    """A drafter distilled on the committed answer shards (``data/answers``): anchors on
    answer positions only, soft labels from the target's top-K, row weights decaying
    with the offset, several sequences per step. ``init``: continue from this drafter
    (its shape and draft vocabulary) instead of a fresh one."""

    answers_dirs: tuple[str, ...] = ("data/answers",)   # answer folders, their features concatenated in order
    shards: int | None = None        # the first N committed shards of each folder (None: every one) ...
    first_shard: int = 0             # ... from this one on (a continuation on the shards added since)
    top_k: int = 16                  # target log-probabilities kept per position (soft labels)
    init: str | None = None          # a drafter directory to start from
    layers: int | None = None        # grow ``init`` to this many layers (``drafter.grown``)
    heldout_prompts: int = 34        # judged on the greedy answers to these held-out prompts ...
    heldout_max_tokens: int = 128    # ... of at most this many tokens
    block_size: int = 6              # the shape of a fresh drafter (ignored with ``init``)
    tap_layers: tuple[int, ...] = (2, 15, 28)
    markov_rank: int = 64
    draft_vocab: int = 8192
    mask_token_id: int = 3
    train: TrainConfig = TrainConfig(steps=2500, lr=5e-4, warmup=100, seqs_per_step=4, anchors_per_seq=12,
                                     row_gamma=4.0, ce_weight=0.1, kl_weight=1.0)


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def build_from_answers(recipe: AnswersRecipe, target, tokenizer, work_dir: Path, out_dir: Path,
                       *, progress: bool = True) -> dict:
    """Features of the committed shards (cached per shard in ``work_dir``), training,
    and the judgement on held-out answers before (``init``) and after."""
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    init_sha = file_digest(Path(recipe.init) / "model.safetensors") if recipe.init else None
    if recipe.init is not None:
        drafter = load_drafter(recipe.init, target=target)
        if tuple(drafter.config.target_layer_ids) != tuple(recipe.tap_layers):
            raise ValueError(f"init drafter taps {drafter.config.target_layer_ids} != recipe {recipe.tap_layers}")
        if recipe.layers is not None:
            drafter = grown(drafter, recipe.layers)
    feats, shards = trainset.answer_features(target, tokenizer, recipe.answers_dirs,
                                             work_dir / "features", shards=recipe.shards,
                                             first_shard=recipe.first_shard,
                                             tap_layers=recipe.tap_layers, top_k=recipe.top_k, progress=progress)
    if recipe.init is None:
        lengths = feats.starts[1:] - feats.starts[:-1]
        in_answer = torch.arange(int(feats.starts[-1])) >= torch.repeat_interleave(
            feats.starts[:-1] + feats.answer_start, lengths)
        d2t = draft_vocabulary(feats.labels[in_answer], recipe.draft_vocab, target.config.vocab_size)
        drafter = new_drafter_for(target, block_size=recipe.block_size, tap_layers=recipe.tap_layers,
                                  markov_rank=recipe.markov_rank, mask_token_id=recipe.mask_token_id,
                                  d2t=d2t, seed=recipe.train.seed)
    pair = ModelPair(target, drafter, tokenizer)
    taps = "-".join(map(str, recipe.tap_layers))
    held = _cached(work_dir / f"heldout-p{recipe.heldout_prompts}-n{recipe.heldout_max_tokens}-taps{taps}.safetensors",
                   lambda: heldout_features(pair, n_prompts=recipe.heldout_prompts,
                                            max_tokens=recipe.heldout_max_tokens, progress=progress))
    before = judge(drafter, held, max_tokens=recipe.heldout_max_tokens)
    result = train_drafter(drafter, feats, recipe.train, work_dir / "checkpoint", target=target, progress=progress)
    after = judge(drafter, held, max_tokens=recipe.heldout_max_tokens)
    save_drafter(drafter, out_dir)
    answer_tokens = int((feats.starts[1:] - feats.starts[:-1] - feats.answer_start).sum())
    report = {
        "recipe": asdict(recipe),
        "init_sha256": init_sha,
        "shards": shards,
        "train_sequences": len(feats),
        "train_tokens": int(feats.tokens.numel()),
        "train_answer_tokens": answer_tokens,
        "heldout_judgement_before": before.as_dict(),   # the init drafter (a fresh one: untrained)
        "heldout_judgement": after.as_dict(),
        "history": result["history"],
        "wall_s": round(time.time() - t0, 1),
    }
    (out_dir / "recipe.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

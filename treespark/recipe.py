"""The recipe that builds the default drafter, end to end and reproducibly.

``build_drafter(recipe, work_dir, out_dir)``:

1. sequences: the offline corpus (``treespark.corpus``) cut into fixed-length
   windows, plus the target's own answers (serving contexts look like these): greedy
   to the train-split prompts and to templated requests (``synthetic_prompts`` and the
   larger ``varied_prompts`` pool), and sampled to the train-split prompts; each set
   is cached on its own in ``work_dir``;
2. features: one teacher-forced target pass per sequence (tapped hidden states and
   the target's argmax labels), cached in ``work_dir``;
3. a reduced draft vocabulary: the most frequent target labels;
4. distillation (``treespark.train``), resumable from ``work_dir``;
5. held-out agreement per block row, written with the recipe beside the drafter.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from treespark.budget import Budget
from treespark.corpus import training_texts
from treespark.drafter import save_drafter
from treespark.models import ModelPair
from treespark.params import SamplingParams
from treespark.prompts import load_prompts, synthetic_prompts, varied_prompts
from treespark.train import (
    Features,
    TrainConfig,
    concat_features,
    draft_vocabulary,
    evaluate,
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
    train: TrainConfig = TrainConfig(steps=12000, lr=1.5e-3, anchors_per_step=48)
    seed: int = 0


def chat_ids(tokenizer, conversation: str | list[dict[str, str]]) -> list[int]:
    """A conversation in the tokenizer's chat template, ready for the assistant's turn.

    ``conversation`` is one user message, or a list of ``{"role", "content"}`` turns
    (user, assistant, user, ...) for a multi-turn request. Every request the project
    formats goes through this one function."""
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def corpus_sequences(tokenizer, total_tokens: int, seq_len: int) -> list[list[int]]:
    ids: list[int] = []
    eos = tokenizer.eos_token_id or 0
    for text in training_texts():
        ids += tokenizer.encode(text) + [eos]
        if len(ids) >= total_tokens:
            break
    ids = ids[:total_tokens]
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def target_answers(pair: ModelPair, prompts: list[list[int]], max_tokens: int,
                   *, temperature: float = 0.0, seed: int = 0, batch_size: int = 16,
                   progress: bool = True) -> list[list[int]]:
    """The target's own answers (plain decoding through the engine, batched)."""
    from treespark.engine import Engine, EngineConfig

    eos = pair.tokenizer.eos_token_id if pair.tokenizer is not None else None
    stop = (eos,) if eos is not None else ()
    longest = max(len(p) for p in prompts)
    engine = Engine(pair, EngineConfig(max_batch_size=batch_size, max_context=longest + max_tokens),
                    budget=Budget.off())
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop,
                                                     temperature=temperature, seed=seed + i))
    answers: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    bar = tqdm(total=len(prompts), desc="target answers", unit="prompt", disable=not progress)
    while engine.has_unfinished():
        for out in engine.step():
            answers[int(out.request_id)] += out.new_token_ids
            bar.update(int(out.finished))
    bar.close()
    return [prompts[i] + answers[i] for i in range(len(prompts))]


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
                        batch_size: int = 16):
        return lambda: target_features(
            target, recipe.tap_layers,
            target_answers(pair, prompts, tokens, temperature=temperature, seed=seed,
                           batch_size=batch_size, progress=progress),
            progress=progress)

    held_feats = _cached(work_dir / f"features_heldout_n{n}.safetensors", answer_features(0.0, 0, held_prompts))
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
    agreement = evaluate(drafter, held_feats)
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

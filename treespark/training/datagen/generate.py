"""The generation loop: the target writes a shard through the engine (questions, first
turns, follow-ups; ``make_shard``), answers are cut at repetition loops and degenerate
ones dropped, and ``generate_shards`` writes the missing shards, resuming from the
committed ones.

``make_shard_captured`` also keeps what the generating forwards computed for the drafter
(the target's tapped states of every position and its top-k log-probabilities at every
answer position; ``Engine.add_request(capture_taps=True)`` and ``SamplingParams.logprobs``),
so a shard's training features need no second pass over its tokens."""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from treespark.models.chat import chat_ids
from treespark.models.pair import ModelPair
from treespark.spec.budget import Budget
from treespark.spec.params import RequestOutput, SamplingParams
from treespark.training.datagen.config import GenConfig
from treespark.training.datagen.reserved import assert_not_reserved, reserved_texts
from treespark.training.datagen.shards import (
    KIND_FOLLOWUP,
    KIND_SELF,
    KIND_WRITE_QUESTION,
    Capture,
    Sample,
    finished_shards,
    shard_meta,
    shard_path,
    write_manifest,
    write_shard,
)
from treespark.training.datagen.sources import Sources, clean_question, plan_shard

if TYPE_CHECKING:
    from treespark.training.train import Features

# -- answers kept ----------------------------------------------------------------------

def cut_repetition(tokens: list[int], n: int = 8, repeats: int = 3) -> list[int]:
    """``tokens`` cut at the start of the first ``repeats``-th occurrence of any
    ``n``-gram (a loop of period p keeps about ``repeats - 1`` periods plus ``n``)."""
    seen: Counter[tuple[int, ...]] = Counter()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        seen[gram] += 1
        if seen[gram] >= repeats:
            return tokens[:i]
    return list(tokens)


def is_degenerate(tokens: list[int], text: str, min_tokens: int) -> bool:
    """Empty, too short, or mostly a few tokens over and over."""
    if len(tokens) < min_tokens or not text.strip():
        return True
    return len(tokens) >= 40 and len(set(tokens)) < 0.1 * len(tokens)


# -- the target writes -----------------------------------------------------------------

def request_seed(cfg: GenConfig, shard: int, index: int, turn: int) -> int:
    """The sampling seed of request ``index`` of ``shard`` at ``turn`` (0: question, 1, 2)."""
    key = f"{cfg.version}/{cfg.seed}/{shard}/{index}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


Progress = Callable[[int], None]


def _capture(outs: list[RequestOutput], answer: list[int]) -> Capture:
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == len(answer) and outs[-1].taps is not None
    return Capture(outs[-1].taps, torch.tensor([[i for i, _ in lp.top] for lp in lps], dtype=torch.int32),
                   torch.tensor([[v for _, v in lp.top] for lp in lps], dtype=torch.float16))


def run_requests(engine, tag: str, prompts: list[list[int]], params: list[SamplingParams],
                 on_tokens: Progress | None = None, *, capture: bool = False,
                 ) -> tuple[list[list[int]], list[Capture] | None]:
    """Each prompt's answer through ``engine`` (the public API only), in prompt order, and
    with ``capture`` (params asking for logprobs) what its forwards computed; ``tag`` keeps
    request ids distinct between calls."""
    base = f"{tag}-"
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{base}{i}", p, sp, capture_taps=capture)
    answers: list[list[int]] = [[] for _ in prompts]
    outs: list[list[RequestOutput]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id[len(base):])
            answers[i] += out.new_token_ids
            if capture:
                outs[i].append(out)
            if on_tokens is not None:
                on_tokens(len(out.new_token_ids))
    return answers, ([_capture(o, a) for o, a in zip(outs, answers, strict=True)] if capture else None)


def make_shard(pair: ModelPair, cfg: GenConfig, sources: Sources, shard: int,
               on_tokens: Progress | None = None) -> list[Sample]:
    """The samples of shard ``shard``: questions written, first turns and follow-ups answered."""
    return _make_shard(pair, cfg, sources, shard, on_tokens, None)[0]


def make_shard_captured(pair: ModelPair, cfg: GenConfig, sources: Sources, shard: int, top_k: int,
                        on_tokens: Progress | None = None) -> tuple[list[Sample], Features]:
    """``make_shard``'s samples (the same ones) and their training features
    (``trainset.captured_features``: the drafter's taps, ``top_k`` soft labels) as the
    generating forwards computed them."""
    from treespark.training.trainset import captured_features

    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (the labels are each position's likeliest token), got {top_k}")
    samples, captures = _make_shard(pair, cfg, sources, shard, on_tokens, top_k)
    return samples, captured_features(samples, captures)


def _make_shard(pair: ModelPair, cfg: GenConfig, sources: Sources, shard: int,
                on_tokens: Progress | None, top_k: int | None) -> tuple[list[Sample], list[Capture] | None]:
    from treespark.engine.config import EngineConfig
    from treespark.engine.core import Engine

    tok = pair.tokenizer
    assert tok is not None, "make_shard needs a pair with a tokenizer"
    reserved = reserved_texts()
    stop = (tok.eos_token_id,)
    engine = Engine(pair, EngineConfig(max_batch_size=cfg.batch_size, max_context=cfg.max_context),
                    budget=Budget.off())
    plans = plan_shard(cfg, sources, shard, reserved)
    samples: list[Sample] = []
    captures: list[Capture] = []  # one per sample, when top_k is set
    requests: list[str] = []  # every user turn sent, checked against the reserved prompts
    capture = top_k is not None

    def add(sample: Sample, cap: list[Capture] | None, i: int) -> None:
        samples.append(sample)
        if cap is not None:
            captures.append(cap[i].cut(len(sample.tokens) - sample.answer_start))

    def finish(ids: list[int]) -> tuple[list[int], bool]:
        kept = cut_repetition(ids, cfg.ngram, cfg.ngram_repeats)
        ok = not is_degenerate(kept, tok.decode(kept, skip_special_tokens=True), cfg.min_answer_tokens)
        return kept, ok

    # 1. the target writes the self-written requests
    selfs = [j for j, p in enumerate(plans) if p.kind == KIND_SELF]
    q_prompts = [chat_ids(tok, plans[j].text) for j in selfs]
    q_params = [SamplingParams(temperature=cfg.question_temperature, max_tokens=cfg.max_question_tokens,
                               stop_token_ids=stop, seed=request_seed(cfg, shard, j, 0), logprobs=top_k)
                for j in selfs]
    firsts: dict[int, str] = {j: p.text for j, p in enumerate(plans) if p.kind != KIND_SELF}
    answers, cap = run_requests(engine, "q", q_prompts, q_params, on_tokens, capture=capture)
    for n, (j, prompt, ids) in enumerate(zip(selfs, q_prompts, answers, strict=True)):
        requests.append(plans[j].text)
        kept, ok = finish(ids)
        if ok:
            add(Sample(prompt + kept, len(prompt), KIND_WRITE_QUESTION, cfg.question_temperature), cap, n)
        q = clean_question(tok.decode(kept, skip_special_tokens=True), reserved) if ok else None
        if q is not None:
            firsts[j] = q

    # 2. first turns
    order = sorted(firsts)
    prompts = [chat_ids(tok, firsts[j]) for j in order]
    keep = [k for k, p in enumerate(prompts) if len(p) <= cfg.max_prompt_tokens]
    order, prompts = [order[k] for k in keep], [prompts[k] for k in keep]
    params = [SamplingParams(temperature=plans[j].temperature, max_tokens=cfg.max_answer_tokens,
                             stop_token_ids=stop, seed=request_seed(cfg, shard, j, 1), logprobs=top_k)
              for j in order]
    f_prompts: list[list[int]] = []
    f_index: list[int] = []
    answers, cap = run_requests(engine, "a", prompts, params, on_tokens, capture=capture)
    for n, (j, prompt, ids) in enumerate(zip(order, prompts, answers, strict=True)):
        requests.append(firsts[j])
        kept, ok = finish(ids)
        if not ok:
            continue
        add(Sample(prompt + kept, len(prompt), plans[j].kind, plans[j].temperature), cap, n)
        followup = plans[j].followup
        if followup is None or len(kept) < len(ids) or kept[-1] not in stop:
            continue  # only complete, uncut answers get a follow-up
        messages = [{"role": "user", "content": firsts[j]},
                    {"role": "assistant", "content": tok.decode(kept, skip_special_tokens=True).strip()},
                    {"role": "user", "content": followup}]
        ids2 = chat_ids(tok, messages)
        if len(ids2) + cfg.max_answer_tokens <= cfg.max_context:
            f_prompts.append(ids2)
            f_index.append(j)
            requests.append(followup)

    # 3. follow-ups
    f_params = [SamplingParams(temperature=plans[j].temperature, max_tokens=cfg.max_answer_tokens,
                               stop_token_ids=stop, seed=request_seed(cfg, shard, j, 2), logprobs=top_k)
                for j in f_index]
    answers, cap = run_requests(engine, "f", f_prompts, f_params, on_tokens, capture=capture)
    for n, (j, prompt, ids) in enumerate(zip(f_index, f_prompts, answers, strict=True)):
        kept, ok = finish(ids)
        if ok:
            add(Sample(prompt + kept, len(prompt), KIND_FOLLOWUP, plans[j].temperature), cap, n)
    assert_not_reserved(requests, reserved)
    return samples, (captures if capture else None)


# -- the run: shard after shard, resumable ---------------------------------------------

def generate_shards(pair: ModelPair, cfg: GenConfig, sources: Sources, out_dir: Path, *,
                    target_tokens: int | None = None, max_shards: int | None = None,
                    features_dir: Path | None = None, top_k: int = 16,
                    progress: bool = True) -> list[int]:
    """Write missing shards (lowest index first) until the committed answer tokens reach
    ``target_tokens`` or ``max_shards`` shards exist; returns the shards written.
    ``features_dir``: also cache each new shard's training features there, from the
    generating forwards (the drafter's taps, ``top_k`` soft labels), where
    ``trainset.shard_features`` looks for them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".shard-*.npz.tmp"):
        stale.unlink()  # a run killed while writing
    done = finished_shards(out_dir)
    metas = [shard_meta(shard_path(out_dir, i)) for i in done]
    for m in metas:
        if m["config_digest"] != cfg.digest():
            raise ValueError(f"{out_dir} holds shard {m['shard']} of another config ({m['config']}); "
                             "use another --out or the same settings")
        if m["sources"] != sources.digest():
            print(f"warning: shard {m['shard']} was built from other sources (another Python?)",
                  file=sys.stderr)
    total = sum(m["answer_tokens"] for m in metas)
    written: list[int] = []
    bar = tqdm(total=target_tokens, initial=total, unit="tok", desc="answer tokens", disable=not progress,
               file=sys.stderr)
    t_run, made, last_log = time.perf_counter(), 0, [time.perf_counter()]

    def on_tokens(n: int) -> None:
        nonlocal made
        made += n
        now = time.perf_counter()
        if progress and now - last_log[0] >= 60:
            last_log[0] = now
            bar.set_postfix_str(f"shard {shard}, {made} generated, {made / (now - t_run):.1f} tok/s", refresh=True)

    while (target_tokens is None or total < target_tokens) and (max_shards is None or len(done) < max_shards):
        shard = next(i for i in range(len(done) + 1) if i not in done)
        t0, before = time.perf_counter(), made
        if features_dir is None:
            samples, feats = make_shard(pair, cfg, sources, shard, on_tokens), None
        else:
            samples, feats = make_shard_captured(pair, cfg, sources, shard, top_k, on_tokens)
        seconds = time.perf_counter() - t0
        answer_tokens = sum(len(s.tokens) - s.answer_start for s in samples)
        meta = {"shard": shard, "version": cfg.version, "seed": cfg.seed, "config": asdict(cfg),
                "config_digest": cfg.digest(), "sources": sources.digest(), "sequences": len(samples),
                "tokens": sum(len(s.tokens) for s in samples), "answer_tokens": answer_tokens}
        write_shard(shard_path(out_dir, shard), samples, meta)
        if feats is not None:
            from treespark.training.trainset import feature_cache, save_features

            save_features(feats, feature_cache(out_dir, shard, features_dir, top_k=top_k,
                                               tap_layers=tuple(pair.drafter.config.target_layer_ids)))
        write_manifest(out_dir)
        done = sorted([*done, shard])
        written.append(shard)
        total += answer_tokens
        bar.update(answer_tokens)
        print(f"shard {shard:05d}: {len(samples)} sequences, {meta['tokens']} tokens, {answer_tokens} answer "
              f"tokens kept; {made - before} generated in {seconds:.0f} s ({(made - before) / seconds:.1f} "
              f"tok/s); total {total} answer tokens, {made / (time.perf_counter() - t_run):.1f} tok/s this run",
              file=sys.stderr, flush=True)
    bar.close()
    return written

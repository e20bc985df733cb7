"""The ``treespark`` command line: fetch, generate, train, calibrate, benchmark."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from treespark.bench.command import add_bench_parser
from treespark.bench.common import write_out
from treespark.engine.cost_measure import MeasureConfig
from treespark.models.errors import ModelLoadError
from treespark.spec.budget import Budget
from treespark.spec.calibration import SIBLING_OFFSETS


def parse_budget(text: str) -> Budget:
    """'adaptive', 'off', 'chain:K' or 'THETA,NODE_CAP,BRANCH_CAP'."""
    if text == "adaptive":
        return Budget.adaptive()
    if text == "off":
        return Budget.off()
    if text.startswith("chain:"):
        return Budget.chain(int(text.split(":", 1)[1]))
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("budget: adaptive | off | chain:K | THETA,NODE_CAP,BRANCH_CAP")
    return Budget(float(parts[0]), int(parts[1]), int(parts[2]))


def cmd_fetch(args) -> None:
    from treespark.models.fetch import fetch_default_target

    print(fetch_default_target(Path(args.cache_dir) if args.cache_dir else None))


def cmd_generate(args) -> None:
    from treespark import generate, load_pair
    from treespark.models.chat import chat_ids

    pair = load_pair(device=args.device)
    ids = chat_ids(pair.tokenizer, args.prompt) if not args.raw else pair.tokenizer.encode(args.prompt)
    out = generate(pair, ids, max_new_tokens=args.max_tokens, temperature=args.temperature,
                   seed=args.seed, budget=args.budget, stop_token_ids=pair.stop_token_ids)
    print(pair.tokenizer.decode(out.token_ids, skip_special_tokens=True))
    print(f"\n[{len(out.token_ids)} tokens in {len(out.rounds) + 1} target forwards "
          f"(prefill + {len(out.rounds)} rounds), {out.tokens_per_round:.2f} tokens/round]", file=sys.stderr)
    if args.rounds:
        for i, r in enumerate(out.rounds):
            print(f"round {i:3d}: tree {r.tree_size:2d} depth {r.depth} width {r.width} "
                  f"accepted {r.accepted} theta {r.theta:.3f}", file=sys.stderr)
    if args.check and args.temperature == 0:
        plain = generate(pair, ids, max_new_tokens=args.max_tokens, budget=Budget.off(),
                         stop_token_ids=pair.stop_token_ids)
        same = plain.token_ids == out.token_ids
        print(f"identical to plain greedy decoding: {same}", file=sys.stderr)
        if not same:
            sys.exit(1)


def cmd_train(args) -> None:
    from dataclasses import replace

    from treespark.models.fetch import load_default_target
    from treespark.training.recipe import (
        AnswersRecipe,
        DrafterRecipe,
        build_drafter,
        build_from_answers,
    )

    if args.from_answers:
        base = AnswersRecipe()
        train = replace(base.train, **{k: v for k, v in (("steps", args.steps), ("lr", args.lr),
                                                          ("seed", args.seed),
                                                          ("anchors_per_seq", args.anchors_per_seq)) if v is not None})
        recipe = replace(base, train=train, answers_dirs=tuple(args.from_answers), shards=args.shards,
                         first_shard=args.first_shard, init=args.init, layers=args.layers)
        print(recipe)
        target, tok = load_default_target(device=args.device)
        report = build_from_answers(recipe, target, tok, Path(args.work_dir), Path(args.out))
        print(f"held-out answers, before: {report['heldout_judgement_before']}")
        print(f"held-out answers, after:  {report['heldout_judgement']}")
        return

    base = DrafterRecipe()
    overrides = {k: v for k, v in (("corpus_tokens", args.corpus_tokens),
                                   ("answer_tokens", args.answer_tokens)) if v is not None}
    train = replace(base.train, **{k: v for k, v in (("steps", args.steps), ("lr", args.lr),
                                                      ("seed", args.seed)) if v is not None})
    recipe = replace(base, train=train, seed=train.seed, **overrides)
    print(recipe)
    target, tok = load_default_target(device=args.device)
    report = build_drafter(recipe, target, tok, Path(args.work_dir), Path(args.out))
    print(f"held-out top-1 agreement by offset: {report['heldout_top1_agreement_by_offset']}")


def cmd_calibrate(args) -> None:
    from treespark import load_pair
    from treespark.training.calibrate import calibrate_pair

    if args.target and not args.drafter:
        raise SystemExit("calibrate: --target needs its --drafter")
    if args.drafter and not args.out and not Path(args.drafter).is_dir():
        raise SystemExit(f"calibrate: {args.drafter} is not a local directory: say where calibration.json "
                         "goes with --out (load_pair reads it from the drafter's directory)")
    pair = load_pair(args.target, args.drafter, device=args.device)
    calibrate_pair(pair, Path(args.out or args.drafter or _default_dir()), sibling_offsets=args.sibling_offsets,
                   sampled_temperature=args.sampled_temperature, temperature_scale=args.temperature_scale)


def cmd_judge(args) -> None:
    import json

    from treespark import load_pair
    from treespark.bench.judge import judgement_table
    from treespark.training.judge import engine_chain_tau, heldout_features, judge
    from treespark.training.train import Features

    pair = load_pair(drafter=args.drafter, device=args.device)
    taps = "-".join(map(str, pair.drafter.config.target_layer_ids))
    cache = Path(args.work_dir) / f"heldout-p{args.prompts}-n{args.max_tokens}-taps{taps}.safetensors"
    if cache.exists():
        feats = Features.load(cache)
    else:
        feats = heldout_features(pair, n_prompts=args.prompts, max_tokens=args.max_tokens)
        cache.parent.mkdir(parents=True, exist_ok=True)
        feats.save(cache)
    result = {"heldout": judge(pair.drafter, feats, max_tokens=args.max_tokens)}
    text = judgement_table({f"{len(feats)} held-out answers, <= {args.max_tokens} tokens": result["heldout"]})
    if args.check_prompts:
        n, m = args.check_prompts, args.check_max_tokens
        result["check"] = judge(pair.drafter, feats.head(n), max_tokens=m)
        blk = pair.drafter.config.block_size
        engine = engine_chain_tau(pair, n, m, tuple(range(1, blk + 1)))
        sim = result["check"].chain_tau
        text += (f"\n\nCheck: the first {n} answers cut at {m} tokens, simulated vs the engine "
                 "(`Budget.chain(k)`, T = 0, as in `treespark bench acceptance`):\n\n")
        text += "| k | " + " | ".join(map(str, range(1, blk + 1))) + " |\n|---|" + "---|" * blk + "\n"
        text += "| simulated tau | " + " | ".join(f"{t:.3f}" for t in sim) + " |\n"
        text += "| engine tau | " + " | ".join(f"{engine[k]:.3f}" for k in range(1, blk + 1)) + " |"
        result["engine_chain_tau"] = [round(engine[k], 4) for k in range(1, blk + 1)]
    write_out(text, args.out)
    if args.json:
        out = {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in result.items()}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def _default_dir() -> str:
    from treespark.models.pair import default_drafter_dir

    return str(default_drafter_dir())


def cmd_cost_model(args) -> None:
    import time

    import torch

    from treespark.engine.cost_measure import measure_cost_model
    from treespark.pricing.costmodel import format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target:  # only the target is timed: no drafter needed
        from transformers import AutoModelForCausalLM

        from treespark.models.pair import pick_device

        dev = pick_device(args.device)
        target = AutoModelForCausalLM.from_pretrained(
            args.target, use_safetensors=True,
            dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).eval().to(dev)
        name = args.target
    elif args.pair == "default":
        from treespark.models.fetch import load_default_target

        target, name = load_default_target()[0], "smollm2-135m-instruct"
    else:
        from treespark.models.pair import pair_by_name

        target, name = pair_by_name("random").target, "random-v512-s0"
    cfg = MeasureConfig(tuple(args.batch_sizes), tuple(args.tokens), args.context, args.repeats,
                        args.max_step_tokens)
    t0 = time.perf_counter()

    def progress(bs: int, k: int, s: float, done: int, total: int) -> None:
        print(f"[{done:3d}/{total}] bs={bs:<3d} k={k:<3d} {s * 1e3:8.1f} ms  "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    cost = measure_cost_model(target, cfg, name=name, on_cell=progress)
    cost.save(args.out)
    print(format_table(cost))
    print(f"written to {args.out}", file=sys.stderr)


def cmd_device_check(args) -> None:
    from dataclasses import replace

    from treespark.bench.device_check import device_check
    from treespark.bench.device_pair import FORWARDS, CheckConfig

    cpu = args.device == "cpu"
    cfg = CheckConfig.cpu() if cpu else CheckConfig()
    if args.batch_sizes:
        cfg = replace(cfg, batch_sizes=tuple(args.batch_sizes))
    if args.forwards:
        cfg = replace(cfg, forwards=tuple(FORWARDS[name] for name in args.forwards))
    result = device_check(cfg, args.out, device=args.device, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"written to {args.out}/device-check.md and {args.out}/device-check.json", file=sys.stderr)
    if not result["ok"]:
        failed = [c["check"] for c in result["checks"] if not c["ok"]] + [f"{s} raised" for s in result["errors"]]
        raise SystemExit(f"device-check: FAILED: {', '.join(failed)}")


def cmd_gen_data(args) -> None:
    from dataclasses import replace

    import torch

    from treespark import load_pair
    from treespark.training.datagen.config import GenConfig
    from treespark.training.datagen.generate import generate_shards
    from treespark.training.datagen.sources import default_sources
    from treespark.training.recipe import AnswersRecipe

    if args.threads:
        torch.set_num_threads(args.threads)
    base = GenConfig()
    cfg = replace(base, **{k: v for k, v in (("seed", args.seed), ("conversations", args.conversations),
                                             ("batch_size", args.batch_size),
                                             ("max_answer_tokens", args.max_answer_tokens),
                                             ("mix", tuple(args.mix) if args.mix else None),
                                             ("greedy_fraction", args.greedy_fraction),
                                             ("followup_fraction", args.followup_fraction)) if v is not None})
    print(cfg, file=sys.stderr)
    pair = load_pair(device=args.device)
    written = generate_shards(pair, cfg, default_sources(cfg.max_snippet_chars), Path(args.out),
                              target_tokens=args.target_tokens, max_shards=args.shards,
                              features_dir=Path(args.work_dir) / "features" if args.work_dir else None,
                              top_k=AnswersRecipe().top_k)
    print(f"wrote shards {written} to {args.out}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="treespark", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch-model", help="download and convert the default target (once)")
    f.add_argument("--cache-dir")
    f.set_defaults(func=cmd_fetch)

    g = sub.add_parser("generate", help="generate text with the default pair")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--budget", type=parse_budget, default=Budget.adaptive())
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--rounds", action="store_true", help="print per-round tree statistics")
    g.add_argument("--check", action="store_true", help="at T=0, compare with plain greedy decoding")
    g.add_argument("--device")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train-drafter", help="distil a DSpark drafter from the default target")
    t.add_argument("--out", required=True)
    t.add_argument("--work-dir", default="runs/drafter-work")
    t.add_argument("--steps", type=int, help="default: the shipped recipe's (DrafterRecipe)")
    t.add_argument("--lr", type=float, help="default: the shipped recipe's")
    t.add_argument("--corpus-tokens", type=int, help="default: the shipped recipe's")
    t.add_argument("--answer-tokens", type=int, help="default: the shipped recipe's")
    t.add_argument("--seed", type=int, help="default: the shipped recipe's")
    t.add_argument("--from-answers", metavar="DIR", nargs="+",
                   help="train on the committed answer shards in these folders (AnswersRecipe; e.g. "
                        "data/answers-chat data/answers-chat-sampled)")
    t.add_argument("--shards", type=int, help="--from-answers: the first N shards of each folder (default: all)")
    t.add_argument("--first-shard", type=int, default=0,
                   help="--from-answers: skip the shards before this one in each folder (default: 0)")
    t.add_argument("--init", help="--from-answers: continue from this drafter directory")
    t.add_argument("--layers", type=int, help="--from-answers with --init: grow the drafter to this many "
                                              "layers first (new layers start as the identity)")
    t.add_argument("--anchors-per-seq", type=int,
                   help="--from-answers: distinct answer anchors per sequence and step (default: AnswersRecipe's)")
    t.add_argument("--device")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("calibrate", help="fit the calibration (a, b) on greedy verification traces and a "
                                         "second map for T > 0 on sampled ones, with sibling-rank offsets (and the "
                                         "variant without them); writes calibration.json")
    c.add_argument("--target", help="a Llama-family causal LM: local directory or hub id (default: the embedded one)")
    c.add_argument("--drafter", help="its DSpark drafter: directory or hub id (default: the shipped one)")
    c.add_argument("--out", help="where calibration.json goes (default: the drafter's directory)")
    c.add_argument("--device")
    c.add_argument("--sampled-temperature", type=float, default=1.0,
                   help="the temperature of the traces the T > 0 map is fitted on (default 1)")
    c.add_argument("--temperature-scale", type=float, default=1.0,
                   help="draw drafts at T > 0 from q at this multiple of T, and fit the sampled map on such "
                        "drafts (default 1: q itself; lossless at any scale; see docs/findings.md)")
    c.add_argument("--sibling-offsets", choices=SIBLING_OFFSETS, default="sampled",
                   help="which maps in use carry sibling-rank offsets: none, the T > 0 map only "
                        "(default), or all (both fits are made and stored)")
    c.set_defaults(func=cmd_calibrate)

    j = sub.add_parser("judge-drafter", help="score a drafter on the target's greedy answers to held-out "
                                             "prompts: agreement by offset, first-token acceptance, "
                                             "simulated T = 0 chain tau (treespark.training.judge)")
    j.add_argument("--drafter", help="drafter directory (default: the shipped one)")
    j.add_argument("--prompts", type=int, default=34, help="held-out prompts (34: all of them)")
    j.add_argument("--max-tokens", type=int, default=128, help="answer tokens per prompt")
    j.add_argument("--check-prompts", type=int, default=0,
                   help="also run the engine's T = 0 chains on this many prompts and compare")
    j.add_argument("--check-max-tokens", type=int, default=48)
    j.add_argument("--work-dir", default="runs/judge", help="caches the held-out answers' features")
    j.add_argument("--json", help="also write the numbers here")
    j.add_argument("--out", help="also write the markdown here")
    j.add_argument("--device")
    j.set_defaults(func=cmd_judge)

    add_bench_parser(sub)

    m = sub.add_parser("cost-model", help="measure the verify-forward time T(bs, k); writes JSON for the policy")
    m.add_argument("--pair", default="default", choices=["default", "random"])
    m.add_argument("--target", help="time this causal LM instead (local directory or hub id)")
    m.add_argument("--device")
    grid = MeasureConfig()
    m.add_argument("--batch-sizes", type=int, nargs="+", default=list(grid.batch_sizes))
    m.add_argument("--tokens", type=int, nargs="+", default=list(grid.tokens),
                   help="tokens per row (root + draft nodes); must start at 1")
    m.add_argument("--context", type=int, default=grid.context, help="committed KV tokens per row")
    m.add_argument("--repeats", type=int, default=grid.repeats, help="timed forwards per cell (its median counts)")
    m.add_argument("--max-step-tokens", type=int, default=grid.max_step_tokens,
                   help="skip (extrapolate) cells with batch x tokens above this")
    m.add_argument("--threads", type=int, help="torch threads (match the replicas' torch_threads)")
    m.add_argument("--out", default="configs/costmodel.json")
    m.set_defaults(func=cmd_cost_model)

    v = sub.add_parser("device-check", help="the one-shot GPU check (no network): correctness of the runner, "
                                            "greedy trees and the loader, then step costs, long context and "
                                            "the bandwidth floor on a random Qwen3-4B-shaped pair; exits "
                                            "non-zero if a correctness check fails (docs/device-check.md)")
    v.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 8 32 (CPU: 1 2)")
    v.add_argument("--forwards", nargs="+", choices=("eager", "inductor", "graphs", "inductor+graphs"),
                   help="the target forwards run, in this order (default: eager graphs inductor+graphs; CPU: eager)")
    v.add_argument("--device", help="default: cuda when present; cpu runs tiny shapes in well under a minute")
    v.add_argument("--out", default="runs/device-check")
    v.set_defaults(func=cmd_device_check)

    d = sub.add_parser("gen-data", help="have the default target write drafter training conversations "
                                        "(resumable shards of token ids; see docs/drafter-data.md)")
    d.add_argument("--out", default="data/answers")
    d.add_argument("--target-tokens", type=int, help="stop once the committed answer tokens reach this")
    d.add_argument("--shards", type=int, help="stop once this many shards exist")
    d.add_argument("--threads", type=int, help="torch threads")
    d.add_argument("--seed", type=int, help="default: GenConfig's")
    d.add_argument("--conversations", type=int, help="first-turn requests per shard (default: GenConfig's)")
    d.add_argument("--batch-size", type=int, help="default: GenConfig's")
    d.add_argument("--max-answer-tokens", type=int, help="default: GenConfig's")
    d.add_argument("--mix", type=float, nargs="+", metavar="W",
                   help="weights of the request sources: self-written, documentation, code[, chat templates] "
                        "(default: GenConfig's three)")
    d.add_argument("--greedy-fraction", type=float, help="share of greedy answers (default: GenConfig's)")
    d.add_argument("--followup-fraction", type=float, help="share of answers that get a follow-up turn "
                                                           "(default: GenConfig's)")
    d.add_argument("--work-dir", help="also cache each new shard's training features in WORK_DIR/features, "
                                      "from the forwards that generate it (train-drafter --work-dir WORK_DIR "
                                      "then needs no second pass over those shards)")
    d.add_argument("--device")
    d.set_defaults(func=cmd_gen_data)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ModelLoadError, ValueError, FileNotFoundError) as e:  # a model that does not load: one line
        print(f"treespark: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

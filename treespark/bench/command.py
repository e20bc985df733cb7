"""``treespark bench``: its arguments and the dispatch to each benchmark module.

Each benchmark lives in its own module under ``treespark.bench`` and is imported only
when asked for (some build large pairs or import optional packages)."""

from __future__ import annotations

import argparse
from pathlib import Path

from treespark.bench.common import write_out


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` subcommand and its options, on the ``treespark`` parser's ``sub``."""
    b = sub.add_parser("bench", help="benchmarks: engine | acceptance | wallclock | theta | linear | ops | rounds | "
                                     "serving | attention | walk")
    b.add_argument("what", choices=["engine", "acceptance", "wallclock", "theta", "linear", "ops", "rounds", "serving",
                                    "attention", "walk"])
    b.add_argument("--pair", default="default", choices=["default", "random"])
    b.add_argument("--precision", default="float32", choices=["float32", "bfloat16"],
                   help="the target's weights (treespark.models.precision)")
    b.add_argument("--also-precision", choices=["float32", "bfloat16"],
                   help="wallclock: the same pair at this precision too, its rows beside (T = 0)")
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--prompts", type=int, default=16)
    b.add_argument("--chains", type=int, nargs="+",
                   help="acceptance, wallclock: chain lengths to tune over; engine: the fixed chains (default 2 4)")
    b.add_argument("--batches", type=int, default=1, help="engine: batches of prompts per cell")
    b.add_argument("--repeats", type=int, default=1, help="engine, ops: passes over the decoders (the median is reported)")
    b.add_argument("--no-per-step", action="store_true",
                   help="engine: leave out the per-step allocation (no startup step-cost table)")
    b.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="acceptance, wallclock: the temperatures")
    b.add_argument("--seed", type=int, default=0,
                   help="acceptance: the first request's sampling seed (request i uses seed + i)")
    b.add_argument("--vocab-size", type=int, default=151_936, help="rounds: the random pair's vocabulary")
    b.add_argument("--draft-vocab", type=int, default=0, help="rounds: a reduced draft vocabulary (0: the full one)")
    b.add_argument("--markov-rank", type=int, default=256, help="rounds: the drafter's Markov rank")
    b.add_argument("--family", default="qwen3", choices=["qwen3", "llama"], help="rounds: the target's architecture")
    b.add_argument("--host", action="store_true",
                   help="rounds: whole decode steps at each of --batch-sizes with trees of 32 (CPU, wall and host "
                        "ms, operator calls, host syncs and uploads per step; with --base, before and after)")
    b.add_argument("--steps", type=int, default=3, help="rounds --host, walk: timed steps per cell")
    b.add_argument("--drafter", help="the default target with this drafter directory (its calibration.json)")
    b.add_argument("--reproducible", action="store_true",
                   help="acceptance: only the adaptive budget at each T > 0, the rejection walk against "
                        "reproducible (position-keyed Gumbel) requests")
    b.add_argument("--goals", action="store_true",
                   help="acceptance: only the drafter's goal rows (first-token, tuned chain, adaptive at a low price)")
    b.add_argument("--base", help="serving, rounds --host: also measure this checkout (the 'before' rows)")
    b.add_argument("--burst-prompt", type=int, default=1500, help="serving: the burst's prompt length")
    b.add_argument("--goodput", action="store_true",
                   help="serving: only decode goodput at --batch-sizes, plain and adaptive, before (--base) and after")
    b.add_argument("--burst-budgets", type=int, nargs="+",
                   help="serving: only the burst, at each of these token budgets a step (TTFT against ITL)")
    b.add_argument("--burst-pair", choices=["default"],
                   help="serving: only the burst on this pair, before (--base, float32) and after at float32 and "
                        "bfloat16 (the served precision), at each of --burst-budgets if given")
    b.add_argument("--out", help="also write the markdown table here")
    b.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> None:
    """``treespark bench WHAT``: build the pair (unless the bench builds its own), run, write."""
    from treespark.models.pair import default_drafter_dir, pair_by_name

    if args.what == "rounds":  # builds its own random pair at the given vocabulary
        from treespark.bench.rounds import rounds_benchmark

        if args.host:
            from treespark.bench.host_steps import host_benchmark

            write_out(host_benchmark(vocab_size=args.vocab_size, draft_vocab=args.draft_vocab,
                                     markov_rank=args.markov_rank, family=args.family,
                                     batch_sizes=tuple(args.batch_sizes), temperatures=tuple(args.temperatures),
                                     steps=args.steps, base=Path(args.base) if args.base else None), args.out)
            return
        write_out(rounds_benchmark(vocab_size=args.vocab_size, draft_vocab=args.draft_vocab,
                                markov_rank=args.markov_rank, family=args.family,
                                temperatures=tuple(args.temperatures)), args.out)
        return
    if args.what == "attention":  # builds the tiny Qwen3 pair (the GPU pair's shapes in miniature)
        from treespark.bench.attention import attention_benchmark

        write_out(attention_benchmark(), args.out)
        return
    if args.what == "serving":  # random pairs, each measured in a subprocess (and the --base checkout's)
        from treespark.bench.serving import (
            burst_frontier,
            default_burst_benchmark,
            goodput_benchmark,
            serving_benchmark,
        )

        if args.burst_pair:
            write_out(default_burst_benchmark(Path(args.base) if args.base else None,
                                              budgets=tuple(args.burst_budgets or [None]),
                                              burst_prompt=args.burst_prompt), args.out)
            return
        if args.goodput:
            write_out(goodput_benchmark(Path(args.base) if args.base else None, tuple(args.batch_sizes)), args.out)
            return
        if args.burst_budgets:
            write_out(burst_frontier(tuple(args.burst_budgets), prompt=args.burst_prompt), args.out)
            return
        write_out(serving_benchmark(base=Path(args.base) if args.base else None, burst_prompt=args.burst_prompt),
               args.out)
        return
    if args.what == "walk":  # builds the tiny Qwen3 pair at the GPU pair's vocabulary
        from treespark.bench.walk import walk_benchmark

        write_out(walk_benchmark(tuple(args.batch_sizes), steps=args.steps), args.out)
        return
    pair = pair_by_name(args.pair, args.drafter, precision=args.precision)
    if args.what == "acceptance" and args.goals:
        from treespark.bench.acceptance import goals_benchmark

        write_out(goals_benchmark(pair, n_prompts=args.prompts, max_tokens=args.max_tokens,
                               chain_lengths=tuple(args.chains or (1, 2, 3, 4, 5)), seed=args.seed,
                               temperatures=tuple(args.temperatures)), args.out)
        return
    if args.what == "acceptance" and args.reproducible:
        from treespark.bench.acceptance import reproducible_benchmark

        write_out(reproducible_benchmark(pair, n_prompts=args.prompts, max_tokens=args.max_tokens, seed=args.seed,
                                         temperatures=tuple(args.temperatures)), args.out)
        return
    if args.what == "engine":
        from treespark.bench.engine_bench import engine_benchmark

        table = engine_benchmark(pair, batch_sizes=tuple(args.batch_sizes), max_tokens=args.max_tokens,
                                 chains=tuple(args.chains or (2, 4)), batches=args.batches, repeats=args.repeats,
                                 per_step=not args.no_per_step)
    elif args.what == "acceptance":
        from treespark.bench.acceptance import acceptance_benchmark
        from treespark.spec.calibration import load_variant

        cal = Path(args.drafter or str(default_drafter_dir())) / "calibration.json"
        variant = load_variant(cal) if args.pair == "default" else None
        table = acceptance_benchmark(pair, max_tokens=args.max_tokens, n_prompts=args.prompts,
                                     chain_lengths=args.chains, variant=variant,
                                     temperatures=tuple(args.temperatures), seed=args.seed)
    elif args.what == "linear":
        from treespark.bench.linear import linear_benchmark

        table = linear_benchmark(pair)
    elif args.what == "ops":
        from treespark.bench.ops import ops_benchmark

        table = ops_benchmark(pair, tuple(args.batch_sizes), args.max_tokens, args.repeats, pair_name=args.pair)
    elif args.what == "theta":
        from treespark.bench.wallclock import theta_sweep

        table = theta_sweep(pair, max_tokens=args.max_tokens, n_prompts=args.prompts,
                            chains=args.chains or (2, 3, 4))
    else:
        from treespark.bench.wallclock import wallclock_benchmark
        from treespark.models.fetch import fetch_gguf

        table = wallclock_benchmark(pair, max_tokens=args.max_tokens, n_prompts=args.prompts,
                                    chains=args.chains or (1, 2, 3, 4),
                                    temperatures=tuple(args.temperatures or (0.0,)),
                                    gguf=fetch_gguf() if args.pair == "default" else None,
                                    other=None if args.also_precision is None else
                                    pair_by_name(args.pair, args.drafter, precision=args.also_precision))
    write_out(table, args.out)

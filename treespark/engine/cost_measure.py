"""Measuring the verify-forward cost model T(bs, k) on the serving hardware.

``treespark cost-model`` times ``TargetRunner.forward`` over a grid of batch sizes and
tokens per row (``MeasureConfig``) with the engine's mask layout, and stores the
result as a ``CostModel`` (``treespark.pricing.costmodel``), the table the controller
prices draft nodes on. This is the torch half of the cost model; the pricing maths
imports no torch.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from treespark.engine.graphs import GraphedForward
from treespark.engine.kv import KVStore, PagedKV, PagedRows, blocks_for
from treespark.engine.target import TargetRunner
from treespark.pricing.costmodel import CostModel, interp, monotone

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24)
# 3 and 6 as well: on CPU the product kernels change between 2 and 3 tokens per row
# (docs/load-experiments.md), and a grid of powers of two would interpolate over that step
DEFAULT_TOKENS = (1, 2, 3, 4, 6, 8, 16, 32, 64)


@dataclass(frozen=True)
class MeasureConfig:
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    tokens: tuple[int, ...] = DEFAULT_TOKENS   # tokens per row (root + draft nodes); must start at 1
    context: int = 256                          # committed KV tokens per row
    repeats: int = 5                            # passes over the grid; a cell keeps its median
    max_step_tokens: int = 2048                 # skip cells with bs * k above this (extrapolated)

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.context < 1:
            raise ValueError("repeats and context must be >= 1")
        if not self.tokens or self.tokens[0] != 1:
            raise ValueError("tokens must start at 1 (plain decoding)")



def chain_batch(bs: int, k: int, context: int, vocab: int, device: torch.device,
                generator=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A timed verify forward's inputs: random tokens and positions [B, K] after
    ``context`` committed tokens a row, and the engine's mask layout [B, 1, K, context + K]
    (context + tree ancestors; a chain mask: the shape of the tree does not change the
    cost)."""
    tokens = torch.randint(0, vocab, (bs, k), generator=generator).to(device)         # [B, K]
    lens = torch.full((bs, 1), context, device=device)
    offsets = torch.arange(k, device=device)[None]
    positions = lens + offsets                                                      # [B, K]
    total = context + k
    cols = torch.arange(total, device=device)[None, None, :]                        # [1, 1, T]
    rel = cols - lens[:, :, None]
    mask = ((rel < 0) | (rel <= offsets[:, :, None])).expand(bs, k, total)[:, None]  # [B, 1, K, T]
    return tokens, positions, mask


def _fastest(call: Callable[[], object], device: torch.device, repeats: int, warmup: bool) -> float:
    """Fastest of ``repeats`` timed calls (after one untimed call with ``warmup``)."""
    times = []
    for i in range(repeats + int(warmup)):
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i or not warmup:
            times.append(time.perf_counter() - t0)
    return min(times)


def time_forward(runner, store, bs: int, k: int, context: int, repeats: int,
                 generator=None, warmup: bool = True) -> float:
    """Fastest of ``repeats`` timed verify forwards (after one warm-up) of ``bs`` rows x
    ``k`` tokens over ``context`` committed tokens per row of a dense store
    (``chain_batch``)."""
    tokens, positions, mask = chain_batch(bs, k, context, runner.vocab_size, runner.device, generator)
    return _fastest(lambda: runner.forward(tokens, positions, positions, store, slice(0, bs), mask),
                    runner.device, repeats, warmup)


def idle_rows(kv: PagedKV, bs: int, length: int) -> PagedRows:
    """``bs`` rows of ``length`` positions over blocks of the pool that no request holds
    and the prefix cache does not keep, each row its own where there are enough (they
    wrap around where there are not; the null block where there are none): a timed
    forward reads as many keys and writes as many slots as a served one, and nothing it
    writes is read again (the startup table's, before the replica serves)."""
    pool = kv.pool
    idle = [b for b in range(1, pool.num_blocks) if pool.ref[b] == 0 and pool.key[b] is None]
    n = bs * blocks_for(length, kv.block_size)
    ids = [idle[i % len(idle)] for i in range(n)] if idle else [0] * n
    table = torch.tensor(ids, dtype=torch.long).view(bs, -1).to(kv.device)
    return kv.rows(table, length)


def time_paged_forward(runner: TargetRunner, kv: PagedKV, bs: int, k: int, context: int, repeats: int,
                       generator=None, warmup: bool = True) -> float:
    """``time_forward`` over the engine's paged store (``idle_rows``): the forward the
    engine verifies with, on the path it takes there (on a CPU, a decoding step's layers
    in one native call, ``treespark.kernels.blocks.layers``)."""
    tokens, positions, mask = chain_batch(bs, k, context, runner.vocab_size, runner.device, generator)
    rows = idle_rows(kv, bs, context + k)
    return _fastest(lambda: runner.forward(tokens, positions, positions, kv.target, rows, mask), runner.device,
                    repeats, warmup)


def time_graphed_forward(graphs: GraphedForward, kv: PagedKV, bs: int, k: int, context: int, repeats: int,
                         generator=None, warmup: bool = True) -> float:
    """``time_paged_forward`` for the verify forward replayed from CUDA graphs (padded to
    its bucket, captured on its first call)."""
    runner = graphs.runner
    tokens, positions, mask = chain_batch(bs, k, context, runner.vocab_size, runner.device, generator)
    rows = idle_rows(kv, bs, context + k)
    return _fastest(lambda: graphs.forward(tokens, positions, positions, rows, mask), runner.device, repeats,
                    warmup)


def _time_once(runner, store, bs: int, k: int, context: int, generator=None) -> float:
    """One timed forward, no warm-up (the cell was warmed in the first pass)."""
    return time_forward(runner, store, bs, k, context, repeats=1, generator=generator, warmup=False)


def measure_cost_model(target, config: MeasureConfig = MeasureConfig(), *, name: str = "",
                       tap_layers: tuple[int, ...] = (0,),
                       on_cell: Callable[[int, int, float, int, int], None] | None = None) -> CostModel:
    """Time ``TargetRunner.forward`` on ``target`` (a transformers causal LM; only the
    target is timed, so no drafter is needed) over the grid. Cells with
    ``bs * k > max_step_tokens`` are filled by linear extrapolation in k from the two
    largest measured k of that batch size. ``on_cell(bs, k, seconds, done, total)``
    reports progress."""
    runner = TargetRunner(target, tap_layers)
    bmax, kmax = max(config.batch_sizes), max(config.tokens)
    store = KVStore(runner.store_shape, bmax, config.context + kmax + 1, runner.device, runner.dtype)
    g = torch.Generator().manual_seed(0)
    cells = [(b, k) for b in config.batch_sizes for k in config.tokens]
    times: dict[tuple[int, int], list[float]] = {}
    todo = [c for c in cells if c[0] * c[1] <= config.max_step_tokens]
    # ``repeats`` passes over the grid, each cell timed once per pass (the first pass
    # with a warm-up): a burst of load from another process then spoils one pass of a
    # few cells, not every repeat of one cell. A cell keeps its median, not its fastest:
    # on CPU the fastest of a few forwards of 3-6 tokens per row came out +13 % over 2
    # tokens, their medians +22 %, and the median is what a served step costs.
    done, total = 0, len(todo) * config.repeats
    for rep in range(config.repeats):
        for b, k in todo:
            t = time_forward(runner, store, b, k, config.context, 1, g) if rep == 0 \
                else _time_once(runner, store, b, k, config.context, g)
            times.setdefault((b, k), []).append(t)
            done += 1
            if on_cell is not None:
                on_cell(b, k, statistics.median(times[(b, k)]), done, total)
    table = {cell: statistics.median(ts) for cell, ts in times.items()}
    seconds: list[tuple[float, ...]] = []
    for b in config.batch_sizes:
        have = [k for k in config.tokens if (b, k) in table]
        if not have:
            raise ValueError(f"max_step_tokens={config.max_step_tokens} leaves batch size {b} unmeasured")
        xs, ys = have, [table[(b, k)] for k in have]
        seconds.append(tuple(table.get((b, k), max(interp(xs, ys, k), ys[-1])) for k in config.tokens))
    return CostModel(tuple(config.batch_sizes), tuple(config.tokens), monotone(seconds), context=config.context,
                     pair=name, device=str(runner.device),
                     threads=torch.get_num_threads(),
                     created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

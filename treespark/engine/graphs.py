"""CUDA-graph replay of the target's verify forward, its shapes padded to buckets.

On a GPU the eager verify forward is launch-bound: at batch 1 it launches ~1,000 small
kernels, one by one from Python, for ~2 ms of memory traffic. A CUDA graph records
those launches once and replays them as one. A graph fixes every shape and address it
was captured with, so, as vLLM v1 does with its capture sizes, the forward's shape is
padded up to a *bucket* and each bucket is captured once, on its first use:

* rows B (``Buckets.rows``);
* tokens per row K (``Buckets.tokens``);
* the block table's columns nb, the key axis (attention reads nb * block_size keys)
  (``Buckets.blocks``): at most twice the keys a step needs;

each to a power of two, or to the engine's largest shape on that axis (``bucket_sizes``).

What the graph reads are the bucket's static input buffers (``StaticInputs``: tokens,
positions, write slots, block table, mask), filled by copies before each replay. A
padding token is token 0 at position 0; its keys and values go to the null block (block
0, never handed out, ``treespark.engine.kv``) and it attends to key 0 only, so it stays
finite and never reaches a real token: every real row's mask (and so its attention
bias) excludes the null block and the padded key columns. The captured part is
``TargetRunner.layers`` (embeddings to the last layer, with the KV writes and the
attention bias); the final norm and the LM head run eagerly on the real tokens only,
so padding costs no logits, and the real rows' logits come from the same product as in
the plain forward.

On CUDA the first call of a bucket warms the forward up on a side stream (torch's
CUDA-graph rules: lazy initialisation and compilation happen outside the capture), then
captures it into one memory pool shared by every bucket (``torch.cuda.graph_pool_handle``;
the graphs never run concurrently); later calls only copy and replay. Elsewhere there
is nothing to capture and the same padded forward over the same static buffers runs
eagerly: what the CPU tests check. A shape above the largest bucket, and every other
forward (prefill, the cost measurements over dense stores), runs eagerly unpadded.

The buckets and that capture machinery (``Buckets``, ``BucketGraphs``) are shared with
the drafter's graphed block pass (``treespark.engine.draft_graphs``), whose graphs an
engine captures into the same pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from treespark.engine.attend import table_attention, table_columns
from treespark.engine.kv import PagedRows, PagedStore, blocks_for
from treespark.engine.target import ForwardOutput, TargetRunner
from treespark.kernels.attention import AttentionPath

WARMUP_CALLS = 2  # eager calls on a side stream before a bucket's capture
Inputs = TypeVar("Inputs")  # a graphed pass's static inputs
Outputs = TypeVar("Outputs")  # ... and its outputs


def bucket_sizes(limit: int) -> tuple[int, ...]:
    """The powers of two below ``limit``, then ``limit`` itself: 1, 2, 4, ..., limit."""
    out = [1]
    while 2 * out[-1] < limit:
        out.append(2 * out[-1])
    return tuple(out) + ((limit,) if limit > 1 else ())


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n``; None above the largest."""
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class BucketShape:
    rows: int     # B, padded
    tokens: int   # K, padded
    blocks: int   # nb, padded: the forward reads blocks * block_size keys


@dataclass(frozen=True)
class Buckets:
    """The padded sizes of each axis, ascending."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]

    @classmethod
    def up_to(cls, rows: int, tokens: int, blocks: int) -> Buckets:
        """``bucket_sizes`` of ``rows`` rows, ``tokens`` tokens a row and ``blocks``
        block-table columns: the largest bucket is the largest shape, never more."""
        return cls(bucket_sizes(rows), bucket_sizes(tokens), bucket_sizes(blocks))

    def shape(self, rows: int, tokens: int, blocks: int) -> BucketShape | None:
        """The bucket of a forward's shape; None where an axis is above its largest."""
        b, k, nb = bucket(rows, self.rows), bucket(tokens, self.tokens), bucket(blocks, self.blocks)
        return None if b is None or k is None or nb is None else BucketShape(b, k, nb)


@dataclass(frozen=True)
class StaticInputs:
    """One bucket's input buffers: the graph reads these addresses, ``fill`` writes them."""

    tokens: torch.Tensor      # [Bp, Kp] long
    positions: torch.Tensor   # [Bp, Kp] long
    slots: torch.Tensor       # [Bp, Kp] long: where each token's keys and values go
    table: torch.Tensor       # [Bp, nbp] long: the blocks attention reads
    mask: torch.Tensor        # [Bp, 1, Kp, nbp * block_size] bool

    @classmethod
    def empty(cls, shape: BucketShape, block_size: int, device: torch.device) -> StaticInputs:
        b, k, nb = shape.rows, shape.tokens, shape.blocks
        ints = [torch.zeros(b, k, dtype=torch.long, device=device) for _ in range(3)]
        return cls(*ints, torch.zeros(b, nb, dtype=torch.long, device=device),
                   torch.zeros(b, 1, k, nb * block_size, dtype=torch.bool, device=device))

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
             mask: torch.Tensor) -> None:
        """Copy a forward's inputs in (tokens, positions, slots [B, K], table [B, nb],
        mask [B, 1, K, T], each no larger than the bucket); the rest is padding: token 0
        at position 0 writing the null block's slot 0, the null block in the table, and
        a padding query that sees key 0 alone (an all-masked query would be NaN, and its
        keys and values would carry that into the null block)."""
        b, k = tokens.shape
        for buf, src in ((self.tokens, tokens), (self.positions, positions), (self.slots, slots),
                         (self.table, table)):
            buf.zero_()
            buf[:b, :src.shape[1]].copy_(src)
        self.mask.zero_()
        self.mask[..., 0] = True
        self.mask[:b, :, :k, :mask.shape[-1]].copy_(mask)


@dataclass
class _Bucket(Generic[Inputs, Outputs]):
    inputs: Inputs
    graph: torch.cuda.CUDAGraph | None = None
    outputs: Outputs | None = None   # the captured body's


class BucketGraphs(Generic[Inputs, Outputs]):
    """The machinery both graphed passes share: a padded pass ``body`` over each bucket's
    static inputs, captured on CUDA into a graph on the bucket's first run and
    replayed after (``capture``; default: on CUDA), or run eagerly over the same buffers.

    ``pool``: the memory pool the graphs are captured into (default: a new one; the
    graphed passes of one engine share one, as they never run concurrently). A graph's
    outputs live in the pool, where another graph's intermediates may lie: they are
    valid until the next replay of any graph of the pool.
    ``captures``: how many buckets have been captured so far; ``shapes``: the buckets
    used so far."""

    def __init__(self, device: torch.device, capture: bool | None = None, pool: tuple[int, int] | None = None) -> None:
        self.device = device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs capture on a CUDA device, not {device}")
        self.pool = pool if pool is not None or not self.capture else torch.cuda.graph_pool_handle()
        self._buckets: dict[BucketShape, _Bucket[Inputs, Outputs]] = {}
        self.captures = 0

    @property
    def shapes(self) -> set[BucketShape]:
        return set(self._buckets)

    def body(self, inputs: Inputs) -> Outputs:
        """The padded pass over a bucket's static inputs: what is captured."""
        raise NotImplementedError

    def _inputs(self, shape: BucketShape, empty: Callable[[], Inputs]) -> Inputs:
        """The static inputs of ``shape``'s bucket (``empty()`` on its first use)."""
        entry = self._buckets.get(shape)
        if entry is None:
            entry = self._buckets[shape] = _Bucket(empty())
        return entry.inputs

    def _run(self, shape: BucketShape) -> Outputs:
        """``body`` over the bucket's static inputs (filled already): replayed from its
        graph, captured first if this is the bucket's first run; or run eagerly."""
        entry = self._buckets[shape]
        if not self.capture:
            return self.body(entry.inputs)
        if entry.graph is None:
            # warm up on a side stream, then capture; the warm-up calls and the first
            # replay compute the same values from the same inputs
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    self.body(entry.inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                entry.outputs = self.body(entry.inputs)
            entry.graph = graph
            self.captures += 1
        entry.graph.replay()
        assert entry.outputs is not None
        return entry.outputs


class GraphedForward(BucketGraphs[StaticInputs, tuple[torch.Tensor, torch.Tensor]]):
    """``TargetRunner.forward`` for verification (a paged store, the grouped attention
    path, logits at every token), its shape padded to a bucket and replayed from a CUDA
    graph (``capture``; default: on CUDA), or run padded and eager (no capture)."""

    def __init__(self, runner: TargetRunner, store: PagedStore, block_size: int, buckets: Buckets,
                 capture: bool | None = None, pool: tuple[int, int] | None = None) -> None:
        if runner.attention is not AttentionPath.GROUPED:
            raise ValueError("CUDA graphs replay the grouped attention path, not "
                             f"{runner.attention.value!r}")
        super().__init__(runner.device, capture, pool)
        self.runner, self.store, self.block_size, self.buckets = runner, store, block_size, buckets

    @torch.no_grad()
    def forward(self,
                tokens: torch.Tensor,      # [B, K]
                positions: torch.Tensor,   # [B, K]
                write_pos: torch.Tensor,   # [B, K] positions of the rows' slots
                rows: PagedRows,           # the batch's block tables and slots
                mask: torch.Tensor,        # [B, 1, K, T] bool
                logits_into: torch.Tensor | None = None,  # as ``TargetRunner.run``
                ) -> ForwardOutput:
        """Logits [B, K, V] (fresh) and taps [B, K, ...]; the taps are a view of the
        bucket's output buffer on CUDA, valid until the next replay of a graph of its
        pool (the engine's next drafter pass)."""
        b, k = tokens.shape
        nb = blocks_for(mask.shape[-1], self.block_size)
        shape = self.buckets.shape(b, k, nb)
        if shape is None:
            return self.runner.forward(tokens, positions, write_pos, self.store, rows, mask, logits_into=logits_into)
        inputs = self._inputs(shape, lambda: StaticInputs.empty(shape, self.block_size, tokens.device))
        inputs.fill(tokens, positions, rows.slots_at(write_pos), table_columns(rows.table, nb), mask)
        x, taps = self._run(shape)
        return ForwardOutput(logits=self.runner.logits(x[:b, :k], "all", logits_into), taps=taps[:b, :k])

    def body(self, inputs: StaticInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded forward's decoder layers over the static buffers."""
        r = self.runner
        attend = table_attention(self.store, inputs.table, self.block_size, inputs.mask, inputs.slots,
                                 groups=r.groups, dtype=r.dtype, scale=r.scaling)
        return r.layers(inputs.tokens, inputs.positions, attend)

"""CUDA-graph replay of the drafter's block pass, its shape padded to buckets.

The drafter's backbone pass (``DSparkDrafter.block_logits``: one forward over a block
of ``block_size`` rows per request, attending its cached context) is as launch-bound on
a GPU as the target's verify forward, and is replayed the same way
(``treespark.engine.graphs``, whose bucket and capture machinery it shares). Its tokens
a row are fixed (the drafter's block size), so two axes are padded:

* rows B, to a power of two or the engine's largest batch;
* the context block table's columns nb (the pass reads nb * block_size keys a row, the
  room for the block included), to a power of two or the blocks of the longest context.

What the graph reads are the bucket's static buffers (``DraftInputs``: anchors,
committed lengths, block table), filled by copies before each replay; the context's
keys and values are gathered from the drafter's KV store through the static table
inside the graph. A padding row is anchor 0 after a context of 0 tokens over a table of
the null block (block 0): it sees only its own block's keys, so it stays finite, and it
writes nothing, since the pass writes the block's keys and values into its own copy of
the context, never into the store. A real row's table is padded with the null block
too, behind its bias. Captured: ``DSparkDrafter.block_hidden`` (embedding to the last
layer); the final norm and the LM head run eagerly on the real rows only
(``block_head``), as in the plain pass. A shape above the largest bucket runs the plain
pass; off CUDA the padded pass runs eagerly over the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespark.engine.attend import PagedContext, table_columns
from treespark.engine.graphs import BucketGraphs, Buckets, BucketShape, bucket_sizes
from treespark.engine.kv import PagedStore, blocks_for
from treespark.models.drafter import DSparkDrafter


def draft_buckets(rows: int, block: int, context: int, block_size: int) -> Buckets:
    """The buckets of an engine of ``rows`` rows, a drafter block of ``block`` rows and
    contexts up to ``context`` tokens, over KV blocks of ``block_size`` slots: the tokens
    axis is the block alone (a pass always has ``block`` tokens a row)."""
    return Buckets(bucket_sizes(rows), (block,), bucket_sizes(blocks_for(context + block, block_size)))


@dataclass(frozen=True)
class DraftInputs:
    """One bucket's input buffers: the graph reads these addresses, ``fill`` writes them."""

    anchors: torch.Tensor   # [Bp] long: each row's root token
    lengths: torch.Tensor   # [Bp] long: each row's committed positions
    table: torch.Tensor     # [Bp, nbp] long: the context's blocks, and room for the block

    @classmethod
    def empty(cls, shape: BucketShape, device: torch.device) -> DraftInputs:
        b, nb = shape.rows, shape.blocks
        return cls(torch.zeros(b, dtype=torch.long, device=device), torch.zeros(b, dtype=torch.long, device=device),
                   torch.zeros(b, nb, dtype=torch.long, device=device))

    def fill(self, anchors: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor) -> None:
        """Copy a pass's inputs in (anchors, lengths [B], table [B, nb], no larger than the
        bucket); the rest is padding: anchor 0, length 0, the null block."""
        b, nb = table.shape
        for buf, src in ((self.anchors, anchors), (self.lengths, lengths)):
            buf.zero_()
            buf[:b].copy_(src)
        self.table.zero_()
        self.table[:b, :nb].copy_(table)


class GraphedDraft(BucketGraphs[DraftInputs, torch.Tensor]):
    """``DSparkDrafter.block_logits`` over the paged drafter store ``store``, its shape
    padded to a bucket (``buckets``: rows, the block size, table columns) and replayed
    from a CUDA graph (``capture``; default: on CUDA), or run padded and eager."""

    def __init__(self, drafter: DSparkDrafter, store: PagedStore, block_size: int, buckets: Buckets,
                 capture: bool | None = None, pool: tuple[int, int] | None = None) -> None:
        super().__init__(next(drafter.parameters()).device, capture, pool)
        self.drafter, self.store, self.block_size, self.buckets = drafter, store, block_size, buckets

    @torch.no_grad()
    def block_logits(self,
                     anchors: torch.Tensor,     # [B]
                     context: PagedContext,     # over ``store``: the batch's table and longest context
                     ctx_len: torch.Tensor,     # [B]
                     depths: int | None = None,
                     ) -> torch.Tensor:
        """``DSparkDrafter.block_logits``: [B, depths, Vd] float32 (fresh; the head runs
        outside the graph, over the first ``depths`` positions, None: all)."""
        assert context.store is self.store and context.block_size == self.block_size and context.tokens is not None
        b, blk = anchors.shape[0], self.drafter.config.block_size
        nb = blocks_for(context.tokens + blk, self.block_size)
        shape = self.buckets.shape(b, blk, nb)
        if shape is None:
            return self.drafter.block_logits(anchors, context, ctx_len, depths)
        inputs = self._inputs(shape, lambda: DraftInputs.empty(shape, anchors.device))
        inputs.fill(anchors, ctx_len, table_columns(context.table, nb))
        return self.drafter.block_head(self._run(shape)[:b, :depths])

    def body(self, inputs: DraftInputs) -> torch.Tensor:
        """The padded pass's hidden states [Bp, block_size, h] over the static buffers."""
        context = PagedContext(self.store, inputs.table, self.block_size, None)
        return self.drafter.block_hidden(inputs.anchors, context, inputs.lengths)

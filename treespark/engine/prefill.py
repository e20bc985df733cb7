"""Prefill: a step's prompt chunks in one target forward, packed with no padding: a
forward of their own when nothing is decoding, else inside the decode step's verify
forward (``treespark.engine.attend.MixedAttention``).

The scheduler hands a step its chunks (``Scheduler.schedule_prefill``: request, tokens),
oldest first. They run as ONE row of N tokens, the chunks one after another
(``PrefillBatch``, built on the host), so that the forward's products cover exactly the
N prompt tokens and each chunk's attention reads only its own request's blocks up to
its own last position (``treespark.engine.attend.ChunkAttention``). A batch padded to
the widest chunk and the longest context pays rows x widest x longest instead: where a
step holds the tail of one prompt, a whole chunk of the next and the head of a third,
three rows of 256 over the longest row's 1,536 keys, for 512 tokens. (A burst of 16 x
1,500-token prompts on the tiny Qwen3 pair, one CPU thread: 1.48 s of prefill padded,
0.90 s packed.)

The forward writes the target's KV at each token's slot; the tapped states of every
position go to the drafter's context cache in one drafter call and one write
(``write_context``, also what a decode step's commit calls); a request whose prompt
ends in the step samples its first token at its own temperature from the logits of its
last position, the only logits the forward computes. One upload carries the step's
inputs; a first token adds one copy back (and one for its logprobs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treespark.engine.accept import sample_firsts
from treespark.engine.attend import ChunkAttention, MixedAttention, chunk_attention, store_attention
from treespark.engine.kv import PagedKV, PagedRows, PagedStore, blocks_for
from treespark.engine.request import Request
from treespark.engine.scheduler import Scheduler
from treespark.engine.target import TargetRunner
from treespark.kernels.transfer import HostTransfers
from treespark.models.drafter import DSparkDrafter
from treespark.spec.logprobs import Emitted, TokenLogprob, step_logprobs
from treespark.spec.tree import TreeBatch


@dataclass(frozen=True)
class PrefillBatch:
    """A step's chunks packed into one row, as host arrays (one upload)."""

    tokens: np.ndarray                    # [N] the chunks' tokens, one after another
    positions: np.ndarray                 # [N] their positions in their requests
    slots: np.ndarray                     # [N] their KV slots (the same in both stores)
    tables: np.ndarray                    # [R, nb] each chunk's block table (the null block past its end)
    spans: tuple[tuple[int, int, int], ...]  # per chunk: (offset in the row, size, first position)
    ends: tuple[bool, ...]                # per chunk: its request's prefill ends here
    firsts: tuple[int, ...]               # the chunks that sample a first token

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.positions.shape == self.slots.shape == (n,)
        assert sum(size for _, size, _ in self.spans) == n and len(self.spans) == len(self.ends) == self.tables.shape[0]

    @property
    def last(self) -> list[int]:
        """The index in the row of the last token of each chunk in ``firsts``."""
        return [self.spans[i][0] + self.spans[i][1] - 1 for i in self.firsts]


def prefill_batch(chunks: list[tuple[Request, int]], kv: PagedKV) -> PrefillBatch:
    """Pack ``chunks`` (request, tokens), each going on from its request's ``computed``
    position. A chunk samples a first token where its request's prompt ends there and it
    has emitted nothing yet (a recomputed request's root is already emitted)."""
    tokens, positions, slots, spans, ends = [], [], [], [], []
    offset = 0
    for req, m in chunks:
        start = req.computed
        pos = list(range(start, start + m))
        tokens += (req.prompt + req.output)[start:start + m]
        positions += pos
        slots += kv.slots(req.blocks, pos)
        spans.append((offset, m, start))
        ends.append(start + m == req.prefill_len)
        offset += m
    nb = max(blocks_for(start + m, kv.block_size) for _, m, start in spans)
    tables = kv.table([req.blocks[:blocks_for(start + m, kv.block_size)]
                       for (req, _), (_, m, start) in zip(chunks, spans, strict=True)], nb)
    firsts = tuple(i for i, (req, _) in enumerate(chunks) if ends[i] and not req.output)
    return PrefillBatch(np.asarray(tokens, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                        np.asarray(slots, dtype=np.int64), tables, tuple(spans), tuple(ends), firsts)


def write_context(drafter: DSparkDrafter, store: PagedStore, pos: torch.Tensor, slots: torch.Tensor,
                  taps: torch.Tensor) -> None:
    """Feed committed positions' tapped hidden states (taps: [N, ...]) to the drafter's
    context cache, in one drafter call and one write: ``pos`` and ``slots`` [N] (on the
    device, uploaded with the step's other inputs) are their positions and slots."""
    drafter.write_context(taps, pos, store.k, store.v, slots)   # (it takes taps in any dtype)


# emit(request, first token, its logprobs) -> the request finished
Emit = Callable[[Request, int, list[TokenLogprob] | None], bool]


@dataclass(frozen=True)
class PrefillInputs:
    """A step's chunks on the device, ready for a forward of their own (``Prefill.step``)
    or to ride in a decode step's verify forward (``treespark.engine.core``)."""

    reqs: list[Request]
    batch: PrefillBatch
    tokens: torch.Tensor      # [N]
    positions: torch.Tensor   # [N]
    slots: torch.Tensor       # [N]
    attend: ChunkAttention
    last: torch.Tensor        # [F] the index of each first-token chunk's last token

    @property
    def logits_for(self) -> torch.Tensor | str:
        """What the forward's LM head computes for the chunks: their first tokens' rows."""
        return self.last if self.batch.firsts else "none"


@dataclass(frozen=True)
class RiddenForward:
    """What one forward over a batch of trees and a prefill's chunks gives each part."""

    logits: torch.Tensor                 # [B, K, V] the trees'
    taps: torch.Tensor                   # [B, K, taps] the trees'
    chunk_taps: torch.Tensor             # [N, taps] the chunks'
    first_logits: torch.Tensor | None    # [F, 1, V] at ``pre.last`` (None: no prompt ends)


def forward_with_trees(runner: TargetRunner, store: PagedStore, rows: PagedRows, trees: TreeBatch,
                       pre: PrefillInputs, logits_into: torch.Tensor | None) -> RiddenForward:
    """ONE target forward over a decode step's trees (``trees``, their KV slots in
    ``rows``) and ``pre``'s chunks after them, as one row (``MixedAttention``); logits
    at every tree node and at the chunks' first-token positions. Eager, padded to
    nothing (a CUDA graph holds a verify forward alone)."""
    n, k = trees.tokens.shape
    mixed = MixedAttention(store_attention(runner.attention, store, rows, trees.write_pos, trees.mask,
                                           groups=runner.groups, dtype=runner.dtype, scale=runner.scaling),
                           pre.attend, n, k)
    heads = torch.arange(n * k, device=trees.tokens.device)
    firsts = bool(pre.batch.firsts)
    if firsts:
        heads = torch.cat([heads, pre.last + n * k])
    out = runner.run(torch.cat([trees.tokens.flatten(), pre.tokens])[None],
                     torch.cat([trees.positions.flatten(), pre.positions])[None], mixed, logits_for=heads,
                     logits_into=logits_into)
    assert out.logits is not None
    taps = out.taps[0]
    return RiddenForward(out.logits[:n * k].view(n, k, -1), taps[:n * k].view(n, k, -1), taps[n * k:],
                         out.logits[n * k:] if firsts else None)


class Prefill:
    """Runs a step's prefill chunks and moves the requests whose prompts end to running."""

    def __init__(self, runner: TargetRunner, drafter: DSparkDrafter, kv: PagedKV, sched: Scheduler,
                 transfers: HostTransfers) -> None:
        self.runner, self.drafter, self.kv, self.sched, self.transfers = runner, drafter, kv, sched, transfers
        self.computed = 0  # prompt positions computed by prefill forwards

    def prepare(self, chunks: list[tuple[Request, int]]) -> PrefillInputs:
        """``chunks`` packed and uploaded (one upload: tokens, positions, slots, block
        tables, the first tokens' indices), their attention built."""
        batch = prefill_batch(chunks, self.kv)
        n, r = batch.tokens.shape[0], len(chunks)
        ints = self.transfers.upload(np.concatenate([batch.tokens, batch.positions, batch.slots,
                                                     batch.tables.ravel(), np.asarray(batch.spans, dtype=np.int64).ravel(),
                                                     np.asarray(batch.last, dtype=np.int64)]), torch.long)
        tokens, pos, slots = ints[:n], ints[n:2 * n], ints[2 * n:3 * n]
        at = 3 * n + batch.tables.size
        attend = chunk_attention(self.runner.attention, self.kv, slots, pos, ints[3 * n:at].view(r, -1),
                                 list(batch.spans), ints[at:at + 3 * r].view(r, 3), groups=self.runner.groups,
                                 dtype=self.runner.dtype, scale=self.runner.scaling)
        return PrefillInputs([req for req, _ in chunks], batch, tokens, pos, slots, attend, ints[at + 3 * r:])

    def step(self, chunks: list[tuple[Request, int]], emit: Emit) -> int:
        """One forward over ``chunks`` alone (``finish`` after it). The tokens computed."""
        if not chunks:
            return 0
        pre = self.prepare(chunks)
        out = self.runner.run(pre.tokens[None], pre.positions[None], pre.attend, logits_for=pre.logits_for)
        return self.finish(pre, out.taps[0], out.logits, emit)

    def finish(self, pre: PrefillInputs, taps: torch.Tensor, logits: torch.Tensor | None, emit: Emit) -> int:
        """After the forward that computed ``pre``'s chunks (``taps`` [N, taps], ``logits``
        [F, 1, V] at ``pre.last``): their tapped states to the drafter's context, each
        request's prompt that ends here joins the running requests (from the next step
        on) and emits its first token through ``emit``. The tokens computed."""
        batch, reqs = pre.batch, pre.reqs
        write_context(self.drafter, self.kv.drafter, pre.positions, pre.slots, taps)
        firsts: dict[int, int] = {}
        lps: dict[int, list[TokenLogprob]] = {}
        if batch.firsts:
            assert logits is not None                                                     # [F, 1, V]
            firsts = dict(zip(batch.firsts, sample_firsts([reqs[i] for i in batch.firsts], logits[:, 0],
                                                           self.transfers), strict=True))
            asked = [Emitted(j, [0], [firsts[i]], reqs[i].params.logprobs) for j, i in enumerate(batch.firsts)
                     if reqs[i].params.logprobs is not None]
            lps = {batch.firsts[e.row]: lp
                   for e, lp in zip(asked, step_logprobs(logits, asked, self.transfers), strict=True)}
        for i, req in enumerate(reqs):
            offset, m, start = batch.spans[i]
            if req.taps is not None:  # (a recomputed request has its earlier positions' already)
                have = sum(x.shape[0] for x in req.taps)
                if start + m > have:
                    req.taps.append(taps[offset + max(have - start, 0):offset + m])
            req.computed = start + m
            self.sched.cache_blocks(req)
            if not batch.ends[i]:
                continue
            self.sched.prefilling.remove(req)
            self.sched.running.append(req)
            if i in firsts and emit(req, firsts[i], lps.get(i)):
                self.sched.release(req)
        n = batch.tokens.shape[0]
        self.computed += n
        return n

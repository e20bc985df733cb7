"""Target forwards to time and count, shared by ``treespark bench ops`` and
``treespark.bench.compile_time``: one verify forward of ``batch`` rows x a tree after a
prefilled context, and plain greedy decoding through the runner alone; both over a
paged store as the engine keeps it (each row its own blocks)."""

from __future__ import annotations

import time

import torch

from treespark.engine.kv import PagedRows, PagedStore, blocks_for
from treespark.engine.target import TargetRunner

CONTEXT = 64
BLOCK = 16                                  # the paged store's block size (the engine's default)
TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 3, 5)   # the 8-node tree of the batch-8 verify forward


def _tree_mask(parents: tuple[int, ...], context: int) -> torch.Tensor:
    """[K, context + K] bool: each node sees the context, itself and its ancestors."""
    k = len(parents)
    mask = torch.zeros(k, context + k, dtype=torch.bool)
    mask[:, :context] = True
    for i in range(k):
        j = i
        while j >= 0:
            mask[i, context + j] = True
            j = parents[j]
    return mask


def paged_rows(runner: TargetRunner, batch: int, length: int) -> tuple[PagedStore, PagedRows]:
    """A paged store and ``batch`` rows of ``length`` positions over it, each row its own
    blocks in order (block 0 is the null block, as in the engine's pool)."""
    nb = blocks_for(length, BLOCK)
    table = 1 + torch.arange(batch * nb, device=runner.device).view(batch, nb)
    store = PagedStore(runner.store_shape, (batch * nb + 1) * BLOCK, runner.device, runner.dtype)
    return store, PagedRows(table, BLOCK, length)


def _depths(parents: tuple[int, ...]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def verify_call(runner: TargetRunner, batch: int, parents: tuple[int, ...], vocab: int):
    """A prefilled store and a closure running one verify forward of ``batch`` rows x
    the tree ``parents`` after ``CONTEXT`` tokens; returns (closure, logits of one call)."""
    g = torch.Generator().manual_seed(0)
    k = len(parents)
    store, rows = paged_rows(runner, batch, CONTEXT + k)
    ctx = torch.randint(0, vocab, (batch, CONTEXT), generator=g)
    pos = torch.arange(CONTEXT).expand(batch, -1)
    causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril()[None, None].expand(batch, -1, -1, -1)
    runner.forward(ctx, pos, pos, store, rows, causal, logits_for="none")
    tokens = torch.randint(0, vocab, (batch, k), generator=g)
    positions = (CONTEXT + torch.tensor(_depths(parents))).expand(batch, -1)
    write = torch.arange(CONTEXT, CONTEXT + k).expand(batch, -1)
    mask = _tree_mask(parents, CONTEXT)[None, None].expand(batch, 1, -1, -1)

    def call() -> torch.Tensor:
        return runner.forward(tokens, positions, write, store, rows, mask).logits

    return call, call()


def decode_goodput(runner: TargetRunner, batch: int, new_tokens: int, vocab: int) -> tuple[float, list[list[int]]]:
    """Plain greedy decoding of ``batch`` rows for ``new_tokens`` after a ``CONTEXT``-token
    prompt: tokens per second (decode steps only) and the tokens."""
    g = torch.Generator().manual_seed(1)
    store, rows = paged_rows(runner, batch, CONTEXT + new_tokens)
    prompt = torch.randint(0, vocab, (batch, CONTEXT), generator=g)
    pos = torch.arange(CONTEXT).expand(batch, -1)
    causal = torch.ones(CONTEXT, CONTEXT + new_tokens, dtype=torch.bool).tril()[None, None].expand(batch, -1, -1, -1)
    token = runner.forward(prompt, pos, pos, store, rows, causal, "last").logits[:, -1].argmax(-1)
    out = [token]
    mask = torch.ones(CONTEXT + new_tokens, CONTEXT + new_tokens, dtype=torch.bool).tril()[None, None]   # row = position
    t0 = time.perf_counter()
    for step in range(new_tokens - 1):
        at = torch.full((batch, 1), CONTEXT + step)
        logits = runner.forward(token[:, None], at, at, store, rows,
                                mask[:, :, CONTEXT + step:CONTEXT + step + 1].expand(batch, 1, 1, -1)).logits
        token = logits[:, -1].argmax(-1)
        out.append(token)
    seconds = time.perf_counter() - t0
    return batch * (new_tokens - 1) / seconds, torch.stack(out, 1).tolist()

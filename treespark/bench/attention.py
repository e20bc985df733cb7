"""``treespark bench attention``: the target's verify forward and the drafter's block
over the paged KV, the reference attention path against the grouped one, side by side.

A scene is a batch of rows, each a committed context of some length in a paged store
(blocks shuffled through the pool, as a pool that has served a while leaves them) and a
random draft tree. Both paths run the same forward on the same store, interleaved
repeat by repeat; the table gives the median step time of each and their ratio, and the
peak of the bytes the step allocates, summed from the profiler's allocation events
(``torch.profiler`` with ``profile_memory=True``: every allocation and free of the step
in time order; the peak of their running sum is what the step holds at most above
what it started with).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from treespark.bench.common import markdown_table
from treespark.bench.serving import peak_bytes
from treespark.engine.attend import ChunkAttention, PagedContext, chunk_attention, store_attention
from treespark.engine.kv import PagedKV, blocks_for
from treespark.engine.target import TargetRunner
from treespark.kernels.attention import AttentionPath
from treespark.kernels.chunks import PackedChunks
from treespark.models.pair import ModelPair
from treespark.spec.tree import DraftTree, tree_batch

QWEN3_PAIR = 'random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3")'


def random_trees(lengths: list[int], nodes: int, vocab: int, rng: np.random.Generator) -> list[DraftTree]:
    """One random tree a row, up to ``nodes`` nodes (the root included), each node hung
    under a random earlier one; row i has ``nodes - i % 3`` nodes (padding in the batch)."""
    trees = []
    for i in range(len(lengths)):
        t = DraftTree.root_only(int(rng.integers(vocab)))
        for _ in range(max(nodes - i % 3, 1) - 1):
            t.add(int(rng.integers(t.num_nodes)), int(rng.integers(vocab)), 0.5, 0.5)
        trees.append(t)
    return trees


@dataclass(frozen=True)
class PagedScene:
    """A batch in a paged store: the rows' contexts filled with random keys and values."""

    kv: PagedKV
    table: torch.Tensor     # [B, nb] each row's blocks (room for its context and its tree)
    lengths: list[int]      # committed context of each row
    trees: list[DraftTree]


def paged_scene(runner: TargetRunner, drafter_shape, lengths: list[int], nodes: int, *, block_size: int = 16,
                seed: int = 0) -> PagedScene:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    need = [blocks_for(n + nodes, block_size) for n in lengths]
    kv = PagedKV(runner.store_shape, drafter_shape, num_blocks=sum(need) + 1, block_size=block_size,
                 device=runner.device, dtype=runner.dtype)
    for store in (kv.target, kv.drafter):
        for t in (store.k, store.v):
            t[:, block_size:] = torch.randn(t[:, block_size:].shape, generator=g).to(t.dtype)
    order = rng.permutation(np.arange(1, sum(need) + 1))        # shuffled blocks, every row its own
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n].tolist())
        at += n
    table = torch.as_tensor(kv.table(tables, max(need)), device=runner.device)
    return PagedScene(kv, table, lengths, random_trees(lengths, nodes, runner.vocab_size, rng))


def verify(runner: TargetRunner, scene: PagedScene) -> torch.Tensor:
    """One verify forward of the scene's trees: logits [B, K, V]."""
    b = tree_batch(scene.trees, scene.lengths, runner.device)
    rows = scene.kv.rows(scene.table, b.mask.shape[-1])
    out = runner.forward(b.tokens, b.positions, b.write_pos, scene.kv.target, rows, b.mask)
    assert out.logits is not None
    return out.logits


def attention_only(runner: TargetRunner, scene: PagedScene) -> torch.Tensor:
    """The verify forward's attention alone, every layer (random queries, the tree's mask):
    what the path changes, without the projections and the LM head around it."""
    b = tree_batch(scene.trees, scene.lengths, runner.device)
    rows = scene.kv.rows(scene.table, b.mask.shape[-1])
    n, k = b.tokens.shape
    q = torch.randn(n, runner.num_heads, k, runner.head_dim, generator=torch.Generator().manual_seed(0))
    attend = store_attention(runner.attention, scene.kv.target, rows, b.write_pos, b.mask, scale=runner.scaling,
                             groups=runner.groups, dtype=runner.dtype)
    return torch.stack([attend(i, q.to(runner.dtype)) for i in range(runner.num_layers)])


def draft(pair: ModelPair, scene: PagedScene, reference: bool) -> torch.Tensor:
    """The drafter's block over the scene's contexts: [B, block, Vd]. ``reference``: every
    layer's context gathered at once, the block concatenated in every layer."""
    d, store = pair.drafter, scene.kv.drafter
    anchors = torch.tensor([t.tokens[0] for t in scene.trees], device=scene.table.device)
    lens = torch.tensor(scene.lengths, device=scene.table.device)
    if reference:
        rows = scene.kv.rows(scene.table, max(scene.lengths))
        ks, vs = zip(*(store.read(i, rows, max(scene.lengths)) for i in range(store.k.shape[0])), strict=True)
        return d.block_logits_dense(anchors, torch.stack(ks), torch.stack(vs), lens)
    return d.block_logits(anchors, PagedContext(store, scene.table, scene.kv.block_size, max(scene.lengths)), lens)


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each of ``fns``, run in turn repeat by repeat (after one warm-up each):
    the process's CPU time, which waiting for a core on a loaded machine does not add to
    (with one thread, the time the step computes)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            if i:
                times[name].append(time.process_time() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


COMMAND = "OMP_NUM_THREADS=1 .venv/bin/python -m treespark.cli bench attention --out docs/results/serving/attention.md"


@torch.no_grad()
def attention_table(pair: ModelPair, *, batch: int = 8, long_context: int = 4096, nodes: int = 16,
                    repeats: int = 9) -> str:
    """Verify forward, its attention alone and the drafter's block at ``batch`` rows of
    ``long_context`` tokens and at short contexts, each path side by side."""
    from treespark.engine.kv import StoreShape

    dc = pair.drafter.config
    dshape = StoreShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim)
    # (the rotary table holds the longest context's positions and its tree's, as an engine's)
    runners = {p: TargetRunner(pair.target, dc.target_layer_ids, attention=p, max_positions=long_context + nodes + 1)
               for p in AttentionPath}
    rng = np.random.default_rng(1)
    contexts = {f"{batch} x {long_context}": [long_context] * batch,
                f"{batch} x 64-512": sorted(rng.integers(64, 513, batch).tolist())}
    rows = []
    for label, lengths in contexts.items():
        scene = paged_scene(runners[AttentionPath.GROUPED], dshape, lengths, nodes)
        for what, fns in (
            ("verify forward", {p: partial(verify, r, scene) for p, r in runners.items()}),
            ("its attention", {p: partial(attention_only, r, scene) for p, r in runners.items()}),
            ("drafter block", {p: partial(draft, pair, scene, p is AttentionPath.REFERENCE) for p in AttentionPath}),
        ):
            ms = interleaved_ms({p.value: f for p, f in fns.items()}, repeats)
            peak = {p.value: peak_bytes(f) / 2**20 for p, f in fns.items()}
            ref, new = AttentionPath.REFERENCE.value, AttentionPath.GROUPED.value
            rows.append([label, what, f"{ms[ref]:.1f}", f"{ms[new]:.1f}", f"{ms[new] / ms[ref]:.2f}",
                         f"{peak[ref]:.1f}", f"{peak[new]:.1f}", f"{peak[new] / max(peak[ref], 1e-9):.2f}"])
    header = ["contexts (B x tokens)", "step", "reference CPU ms", "grouped CPU ms", "time ratio",
              "reference peak MiB", "grouped peak MiB", "peak ratio"]
    goal = float(rows[0][4])
    verdict = (f"Goal (#41): the grouped verify step at {batch} x {long_context} in at most 0.5x the "
               f"reference's time: {'met' if goal <= 0.5 else 'not met'} ({goal:.2f}x).")
    return markdown_table(header, rows) + "\n\n" + verdict


CHUNK_HEADS = {"tiny pairs (4 / 2 heads of 16)": (4, 2, 16), "default target (9 / 3 of 64)": (9, 3, 64),
               "Qwen3-4B (32 / 8 of 128)": (32, 8, 128)}
CHUNK_SETS = {"256 at 1,024": [(256, 1024)], "2 x 256 at 0 and 1,244": [(256, 0), (256, 1244)],
              "512 at 0": [(512, 0)]}


@torch.no_grad()
def chunk_table(*, repeats: int = 9, block_size: int = 16) -> str:
    """A prefill step's chunk attention, one layer, each side a ``ChunkAttention`` prepared
    as the engine prepares it (masks, biases and block columns once a forward, outside the
    timing): chunk by chunk through SDPA (``chunk_attention(native=False)``) against the
    native call (``treespark.kernels.chunks``), at three head shapes, each chunk's blocks
    shuffled through a pool of random keys and values."""
    from treespark.engine.kv import StoreShape

    g = torch.Generator().manual_seed(0)
    rows = []
    for label, (h, kvh, hd) in CHUNK_HEADS.items():
        for chunks_label, chunks in CHUNK_SETS.items():
            nb = max(blocks_for(start + size, block_size) for size, start in chunks)
            kv = PagedKV(StoreShape(1, kvh, hd), StoreShape(1, 1, hd), num_blocks=len(chunks) * nb,
                         block_size=block_size, device=torch.device("cpu"), dtype=torch.float32)
            for store in (kv.target.k, kv.target.v):
                store[0] = torch.randn(store.shape[1:], generator=g)
            tables = torch.randperm(len(chunks) * nb, generator=g).view(len(chunks), nb)
            offsets = np.cumsum([0] + [size for size, _ in chunks]).tolist()
            spans = [(o, size, start) for o, (size, start) in zip(offsets, chunks, strict=False)]
            positions = torch.cat([torch.arange(start, start + size) for size, start in chunks])
            table_of = torch.cat([torch.full((size,), i) for i, (size, _) in enumerate(chunks)])
            slots = tables[table_of, positions // block_size] * block_size + positions % block_size
            q = torch.randn(1, h, offsets[-1], hd, generator=g)
            span_table = torch.tensor(spans, dtype=torch.int64)
            attends = {"torch": chunk_attention(AttentionPath.GROUPED, kv, slots, positions, tables, spans,
                                                span_table, groups=h // kvh, dtype=torch.float32,
                                                scale=hd ** -0.5, native=False),
                       # what ``chunk_attention`` makes where the native call takes the heads, made here
                       # past ``MAX_HEAD`` too (the row that shows why it stops there)
                       "native": ChunkAttention(AttentionPath.GROUPED, kv.target, slots, (), hd ** -0.5,
                                                PackedChunks(tables, span_table, block_size))}
            fns = {name: partial(attend, 0, q) for name, attend in attends.items()}
            err = (fns["torch"]() - fns["native"]()).abs().max().item()
            ms = interleaved_ms(fns, repeats)
            rows.append([label, chunks_label, f"{ms['torch']:.2f}", f"{ms['native']:.2f}",
                         f"{ms['native'] / ms['torch']:.2f}", f"{err:.0e}"])
    return markdown_table(["heads", "chunks (tokens at position)", "torch path CPU ms", "native CPU ms",
                           "native / torch", "largest difference"], rows)


def attention_benchmark(**kwargs) -> str:
    """The results page of ``treespark bench attention`` on the tiny Qwen3 pair."""
    from treespark.kernels.machine import hardware_name
    from treespark.models.pair import random_pair

    pair = random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3")
    table = attention_table(pair, **kwargs)
    return "\n".join([
        "# Attention over the paged KV: reference vs grouped path (#41)", "",
        "Command (both paths measured in one run, interleaved repeat by repeat; the median of 9 of the "
        "process's CPU time, 1 thread):", "",
        f"    {COMMAND}", "",
        f"Machine: {hardware_name()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s). "
        f"Pair: `{QWEN3_PAIR}` (3 layers, 4 query / 2 KV heads of 16, hidden 64). Trees of 16 nodes "
        "(random shapes, rows padded), blocks of 16 shuffled through the pool.", "",
        table, "",
        "*verify forward*: `TargetRunner.forward` over the batch's trees (projections, attention, the "
        "151,936-row LM head at every node); *its attention*: the same forward's attention alone, every "
        "layer (gather and kernel); *drafter block*: `block_logits` (reference: every layer's context "
        "gathered, the block concatenated in each layer). Peak: the most bytes the step holds at once "
        "above what it started with, from the profiler's allocation events (`profile_memory=True`).", "",
        "## A prefill step's chunks, one layer", "",
        chunk_table(), "",
        "Both as the engine prepares them (`treespark.engine.attend.chunk_attention`, once a forward, not "
        "timed), one layer's attention timed. *torch path*: per chunk its blocks gathered into a copy and "
        "SDPA's flash kernel under the chunk's causal bias (`native=False`: what an accelerator runs); "
        "*native*: every chunk in one call, blocks read in place, queries in the vector lanes, no key past "
        "a query's position computed (`treespark.kernels.chunks`; the engine uses it for heads up to "
        "`MAX_HEAD`).",
    ])

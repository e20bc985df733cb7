"""KV storage: a pool of fixed-size blocks per model, block tables per request, and the
prefix cache over those blocks (vLLM v1's KV cache manager, adapted to draft trees).

Memory is blocks, not rows. The target and the drafter each have one store of
``num_blocks * block_size`` token slots, ``[layers, slots, kv_heads, head_dim]``; block
``b`` holds slots ``b * block_size .. (b + 1) * block_size - 1`` in both stores, so one
block table per request addresses both models. Block 0 is the *null block*: padding
(tree padding, block-table padding) reads and writes it, nothing keeps anything there.

A request's positions ``0 .. computed - 1`` are committed. A step writes its tree at
``computed .. computed + K - 1`` (in the request's tail blocks, allocated before the
step), verification moves the accepted nodes' entries down next to the committed
context, and the rejected slots are simply left behind beyond ``computed`` (dead, reused
by the next step's tree).

Prefix caching (``BlockPool``): a block whose every slot is committed is keyed by the
hash of its tokens chained with its prefix's key, and found again by a later request
with the same prefix. Blocks are reference counted; a block nobody holds goes to the
back of the free queue with its key kept, and is evicted (its key dropped) only when
the front of the queue is allocated: LRU. A block holding tree (uncommitted) tokens is
never keyed, so drafts never enter the cache.

The dense ``KVStore`` (one row per sequence, a view per batch) stays for the forwards
that measure costs and train, which run a fixed batch over one sequence each.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from treespark.kernels.attention import block_slots


@dataclass(frozen=True)
class StoreShape:
    layers: int
    kv_heads: int
    head_dim: int


def bytes_per_token(target: StoreShape, drafter: StoreShape, dtype: torch.dtype) -> int:
    """Bytes one token position takes in both stores (keys and values, every layer)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * elem * sum(s.layers * s.kv_heads * s.head_dim for s in (target, drafter))


def device_kv_budget(device: torch.device, fraction: float) -> int:
    """``fraction`` of the device's memory, less what is already in use (the weights,
    other processes): vLLM's gpu_memory_utilization rule. On CPU: of the available RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(fraction * total) - (total - free))
    import os

    return int(fraction * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def pool_blocks(per_request: int, block_bytes: int, *, max_batch_size: int, kv_blocks: int, budget_bytes: int,
                memory_fraction: float, device: torch.device) -> int:
    """Blocks in the pool (the null block aside): ``kv_blocks`` when > 0; else what
    ``max_batch_size`` requests at their longest take (``per_request`` blocks each; more
    would only keep cached prefixes longer), cut to the byte budget and to
    ``memory_fraction`` of the device (``device_kv_budget``) where given. Raises
    ValueError where one request at its longest would not fit."""
    limits = [budget_bytes] if budget_bytes else []
    if memory_fraction:
        limits.append(device_kv_budget(device, memory_fraction))
    blocks = max_batch_size * per_request
    if kv_blocks:
        blocks = kv_blocks
    elif limits:
        blocks = min(blocks, min(limits) // block_bytes)
    if blocks < per_request:
        raise ValueError(f"the KV pool ({blocks} blocks, {blocks * block_bytes / 2**20:.1f} MiB) holds fewer than "
                         f"the {per_request} blocks one request at max_context and its largest tree needs: lower "
                         f"max_context or raise the budget")
    return blocks


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def block_hashes(tokens: list[int], block_size: int, parent: bytes = b"", start: int = 0) -> list[bytes]:
    """Chain hashes of the full blocks of ``tokens`` from block ``start`` on (``parent``:
    the key of block ``start - 1``): key_i = H(key_{i-1} || tokens of block i)."""
    out = []
    for i in range(start, len(tokens) // block_size):
        parent = hashlib.blake2b(parent + array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes(),
                                 digest_size=16).digest()
        out.append(parent)
    return out


class BlockPool:
    """Host bookkeeping of the blocks: reference counts, the free queue (LRU first) and
    the prefix cache (key -> block). Block 0 (the null block) is never handed out."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        assert num_blocks >= 2, "a pool needs the null block and at least one more"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def blocks_in_use(self) -> int:
        return self.num_usable - self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue (evicting their cached keys)."""
        assert n <= self.num_free, f"{n} blocks asked, {self.num_free} free"
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            k = self.key[b]
            if k is not None:
                if self.cached.get(k) == b:
                    del self.cached[k]
                self.key[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the tail first, so that a request's last
        blocks (the least shared) are evicted before its prefix."""
        for b in reversed(blocks):
            assert self.ref[b] > 0, f"block {b} freed twice"
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_queue[b] = None

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (not yet held)."""
        out = []
        if self.caching:
            for k in keys:
                b = self.cached.get(k)
                if b is None:
                    break
                out.append(b)
        return out

    def hold(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks found by ``lookup``."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.free_queue[b]
            self.ref[b] += 1

    def register(self, block: int, key: bytes) -> None:
        """Key a block whose every slot is committed. The first block with a key keeps
        it: a second block of the same content stays unkeyed."""
        if self.caching and self.key[block] is None and key not in self.cached:
            self.key[block] = key
            self.cached[key] = block


@dataclass(frozen=True)
class PagedRows:
    """A batch's view of a paged store, positions 0 .. ``length`` - 1 of each row of the
    block table ``table``: ``slots[b, t]`` is the slot of row b's position t (the null
    block's where the row has no block there), made the first time a path reads every
    position (the reference path's gather); a forward that only writes its tokens looks
    theirs up alone (``slots_at``)."""

    table: torch.Tensor  # [B, nb] block ids, on the device
    block_size: int
    length: int          # T

    @cached_property
    def slots(self) -> torch.Tensor:
        """[B, T] long, on the device."""
        bs, nb = self.block_size, self.table.shape[1]
        cols = torch.arange(self.length, device=self.table.device)
        blk = (cols // bs).clamp(max=nb - 1)
        ids = torch.where((cols // bs < nb)[None], self.table[:, blk], 0)
        return ids * bs + cols % bs

    def slots_at(self, pos: torch.Tensor) -> torch.Tensor:
        """The slots of positions ``pos`` [B, S] (each within its row's blocks): ``slots``
        gathered at ``pos``, without making it."""
        return block_slots(self.table, pos, self.block_size)


class PagedStore:
    """Keys and values of one model: ``[layers, num_blocks * block_size, kv_heads, head_dim]``."""

    def __init__(self, shape: StoreShape, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        dims = (shape.layers, num_slots, shape.kv_heads, shape.head_dim)
        # zeros, not empty: a masked-out NaN would still poison attention (0 * NaN)
        self.k = torch.zeros(dims, device=device, dtype=dtype)
        self.v = torch.zeros(dims, device=device, dtype=dtype)

    def write(self, layer: int, rows: PagedRows, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """pos: [B, S] positions (within the rows' blocks); k, v: [B, kvh, S, hd]."""
        self.write_at(layer, rows.slots_at(pos), k, v)

    def write_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [B, S] the slot of each new token; k, v: [B, kvh, S, hd]."""
        slots = slots.flatten()
        self.k[layer, slots] = k.transpose(1, 2).flatten(0, 1).to(self.k.dtype)
        self.v[layer, slots] = v.transpose(1, 2).flatten(0, 1).to(self.v.dtype)

    def read(self, layer: int, rows: PagedRows, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..t-1 gathered slot by slot into [B, kvh, t, hd]
        (a copy): the reference attention path's read (``treespark.engine.attend``)."""
        s = rows.slots[:, :t]
        return self.k[layer, s].transpose(1, 2), self.v[layer, s].transpose(1, 2)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the entries of slots ``src`` to slots ``dst`` (every layer), [N] each: the
        whole batch's moves in one gather and one scatter; every source is read before any
        destination is written (the gather is a copy)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


class PagedKV:
    """The target's and the drafter's paged stores over one ``BlockPool``."""

    def __init__(self, target: StoreShape, drafter: StoreShape, *, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, caching: bool = True) -> None:
        self.block_size = block_size
        self.device = device
        self.target_shape, self.drafter_shape = target, drafter
        self.pool = BlockPool(num_blocks, block_size, caching)
        self.target = PagedStore(target, num_blocks * block_size, device, dtype)
        self.drafter = PagedStore(drafter, num_blocks * block_size, device, dtype)

    @property
    def blocks_in_use(self) -> int:
        return self.pool.blocks_in_use

    def table(self, tables: list[list[int]], nb: int) -> np.ndarray:
        """Block tables as one host array [B, nb] (the null block past a table's end), to
        go up to the device with the step's other inputs (``HostTransfers.upload``)."""
        tab = np.zeros((len(tables), nb), dtype=np.int64)
        for i, blocks in enumerate(tables):
            m = min(len(blocks), nb)
            tab[i, :m] = blocks[:m]
        return tab

    def rows(self, table: torch.Tensor, t: int) -> PagedRows:
        """Positions 0..t-1 of each row of ``table`` ([B, nb] block ids on the device;
        positions past its last column map to the null block)."""
        return PagedRows(table, self.block_size, t)

    def slots(self, blocks: list[int], positions: list[int]) -> list[int]:
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in positions]


class KVStore:
    """Dense keys and values of one model, one row per sequence:
    [layers, slots, kv_heads, capacity, head_dim] (the cost measurements and training)."""

    def __init__(self, shape: StoreShape, slots: int, capacity: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        dims = (shape.layers, slots, shape.kv_heads, capacity, shape.head_dim)
        self.k = torch.zeros(dims, device=device, dtype=dtype)
        self.v = torch.zeros(dims, device=device, dtype=dtype)

    def write(self, layer: int, rows: slice, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """pos: [B, S] positions; k, v: [B, kvh, S, hd] for the rows of ``rows``."""
        b = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        self.k[layer, rows][b, :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer, rows][b, :, pos] = v.transpose(1, 2).to(self.v.dtype)

    def read(self, layer: int, rows: slice, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, kvh, t, hd] views of the rows' first t positions."""
        return self.k[layer, rows, :, :t], self.v[layer, rows, :, :t]

"""Preallocated KV storage for the target and the drafter, one row (slot) per request.

Layout per store: [layers, slots, kv_heads, capacity, head_dim]. Running requests
occupy rows 0..n-1 (the engine keeps them compact, so a batch is a view, never a
gather), and one extra *staging* row holds the prompt being prefilled. Each step
writes the round's tree at positions L..L+K-1 of a row; verification then moves the
accepted nodes' entries down to L+1, L+2, ... (only those entries are copied);
anything beyond a row's committed length is dead and masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StoreShape:
    layers: int
    kv_heads: int
    head_dim: int


def bytes_per_token(target: StoreShape, drafter: StoreShape, dtype: torch.dtype) -> int:
    """Bytes one token position takes in both stores (keys and values, every layer)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * elem * sum(s.layers * s.kv_heads * s.head_dim for s in (target, drafter))


def rows_within(budget_bytes: int, row_bytes: int, max_batch: int) -> int:
    """How many running rows a KV budget holds beside the prefill row (at most
    ``max_batch``). Rows are dense, a full context each: a budget below two rows is an
    error that says what one row needs."""
    rows = budget_bytes // row_bytes - 1
    if rows < 1:
        raise ValueError(f"the KV budget ({budget_bytes / 2**20:.1f} MiB) holds fewer than 2 rows of "
                         f"{row_bytes / 2**20:.1f} MiB (one running request and the prefill row, each a full "
                         f"max_context): lower max_context or raise the budget")
    return min(max_batch, rows)


def device_kv_budget(device: torch.device, fraction: float) -> int:
    """``fraction`` of the device's memory, less what is already in use (the weights,
    other processes): vLLM's gpu_memory_utilization rule. On CPU: of the available RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(fraction * total) - (total - free))
    import os

    return int(fraction * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class KVStore:
    """Keys and values of one model."""

    def __init__(self, shape: StoreShape, slots: int, capacity: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        dims = (shape.layers, slots, shape.kv_heads, capacity, shape.head_dim)
        # zeros, not empty: a masked-out NaN would still poison attention (0 * NaN)
        self.k = torch.zeros(dims, device=device, dtype=dtype)
        self.v = torch.zeros(dims, device=device, dtype=dtype)

    def write(self, layer: int, rows: slice, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """pos: [B, S] positions; k, v: [B, kvh, S, hd] for the rows of ``rows``."""
        b = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        self.k[layer, rows][b, :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer, rows][b, :, pos] = v.transpose(1, 2).to(self.v.dtype)

    def write_all(self, rows: slice, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [L, B, kvh, S, hd] for every layer at once."""
        for layer in range(k.shape[0]):
            self.write(layer, rows, pos, k[layer], v[layer])

    def write_entries(self, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Entries of many rows at once: slots, pos [N]; k, v [L, kvh, N, hd] (every layer)."""
        self.k[:, slots, :, pos] = k.permute(2, 0, 1, 3).to(self.k.dtype)
        self.v[:, slots, :, pos] = v.permute(2, 0, 1, 3).to(self.v.dtype)

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy entries at (slots, src) to (slots, dst) (all layers); [N] each. Every source
        is read before any destination is written."""
        self.k[:, slots, :, dst] = self.k[:, slots, :, src]
        self.v[:, slots, :, dst] = self.v[:, slots, :, src]

    def copy_row(self, src_slot: int, dst_slot: int, length: int) -> None:
        self.k[:, dst_slot, :, :length] = self.k[:, src_slot, :, :length]
        self.v[:, dst_slot, :, :length] = self.v[:, src_slot, :, :length]


class KVCache:
    """The target's and the drafter's stores, with slot bookkeeping.

    ``lengths[s]`` is the committed length of slot s (0 = free). Slot ``staging``
    (the last one) is reserved for prefill.
    """

    def __init__(self, target: StoreShape, drafter: StoreShape, *, max_batch: int,
                 capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        self.max_batch = max_batch
        self.capacity = capacity
        self.staging = max_batch
        slots = max_batch + 1
        self.target = KVStore(target, slots, capacity, device, dtype)
        self.drafter = KVStore(drafter, slots, capacity, device, dtype)
        self.lengths = [0] * slots

    def move_entries(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move entries within rows, both stores: (slots[i], src[i]) -> (slots[i], dst[i]),
        [N] device tensors of every row's moves at once."""
        self.target.move(slots, src, dst)
        self.drafter.move(slots, src, dst)

    def copy_row(self, src_slot: int, dst_slot: int) -> None:
        n = self.lengths[src_slot]
        self.target.copy_row(src_slot, dst_slot, n)
        self.drafter.copy_row(src_slot, dst_slot, n)
        self.lengths[dst_slot] = n
        self.lengths[src_slot] = 0

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    @property
    def slots_in_use(self) -> int:
        return sum(1 for n in self.lengths if n > 0)


"""The engine's requests and their KV blocks (vLLM v1's scheduler and KV cache manager, for
draft trees): the waiting queue, the admitted requests still prefilling, the running ones,
and the blocks each holds in the ``PagedKV`` pool.

Every step, ``reserve_trees`` gives each running request the blocks its next tree may
write, oldest first, preempting the newest request holding blocks where the pool runs
out (by recomputation: its blocks freed, itself back at the front of the queue, its
output and sampler kept); ``schedule_prefill`` then fills the step's token budget, after
the running rows' trees, with prefill chunks: the admitted requests' first, then new
ones admitted first come first served while a request slot is free and the pool holds
their prompt's uncached blocks and one tree, each reusing the longest prefix of cached
blocks. ``cache_blocks`` keys the blocks a request has filled with committed positions.

Host bookkeeping only: nothing here touches a tensor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from treespark.engine.kv import PagedKV, block_hashes, blocks_for
from treespark.engine.request import Request


class Scheduler:
    def __init__(self, kv: PagedKV, tree_slots: Callable[[Request], int], *, max_batch_size: int,
                 max_num_batched_tokens: int, prefill_chunk: int,
                 kv_room: Callable[[Request], int] | None = None) -> None:
        """``tree_slots(req)``: positions one step's tree of ``req`` may write (its root and
        its node cap: the tokens its step verifies); ``kv_room(req)``: positions past its
        committed ones its blocks hold for a step (its tree's, and the drafter's block,
        written there in place; default ``tree_slots``)."""
        self.kv = kv
        self.tree_slots = tree_slots
        self.kv_room = tree_slots if kv_room is None else kv_room
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []   # admitted, holding blocks, prompt not yet computed
        self.running: list[Request] = []
        self._admitted = 0
        self.on_schedule: Callable[[str], None] | None = None  # a request id leaving the waiting queue
        self.preemptions = 0            # requests preempted (by recomputation) so far
        self.prefix_cache_queries = 0   # prompt tokens looked up in the prefix cache (vLLM's names)
        self.prefix_cache_hits = 0      # of those, tokens found cached (not computed)

    @property
    def has_requests(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def remove(self, request_id: str) -> Request:
        """Take a request out wherever it is (its blocks freed)."""
        req = next((r for r in self.waiting if r.id == request_id), None)
        if req is not None:
            self.waiting.remove(req)
            return req
        req = next(r for r in self.prefilling + self.running if r.id == request_id)
        self.release(req)
        return req

    def reserve_trees(self) -> None:
        """Give every running request the blocks its next tree may take, oldest first;
        where the pool runs out, preempt the newest request holding blocks."""
        pool, bs = self.kv.pool, self.kv.block_size
        for req in sorted(self.running, key=lambda r: r.seq):
            if req not in self.running:
                continue  # preempted for an older one
            need = blocks_for(req.computed + self.kv_room(req), bs) - len(req.blocks)
            while need > pool.num_free:
                victim = max(self.running + self.prefilling, key=lambda r: r.seq)
                self.preempt(victim)
                if victim is req:
                    break
            else:
                if need > 0:
                    req.blocks += pool.allocate(need)

    def preempt(self, req: Request) -> None:
        """Free a request's blocks and put it back at the front of the queue, to be
        recomputed (its output and sampler kept: it resumes exactly)."""
        self.release(req)
        req.keys, req.computed = [], 0
        self.waiting.appendleft(req)
        self.preemptions += 1

    def schedule_prefill(self) -> list[tuple[Request, int]]:
        """This step's prefill chunks (request, tokens): what the token budget leaves after
        the running rows' trees, and at least a chunk less a token a running row (each row's
        root, verified whatever its tree), so that prompts move at about a chunk a step even
        where the rows' node caps reserve the whole budget; to the admitted requests oldest
        first, then to waiting requests admitted, first come first served, while a request
        slot is free and the pool holds their prompts' uncached blocks and a tree. (A whole
        chunk beside decoding rows would pass the budget: on a CPU's tiles, 256 prompt
        tokens and a decoding row are 17 groups of 16 rows.)"""
        budget = max(self.max_num_batched_tokens - sum(self.tree_slots(r) for r in self.running),
                     max(self.prefill_chunk - len(self.running), self.kv.block_size))
        chunks = []
        for req in self.prefilling:
            if budget <= 0:
                return chunks
            m = min(req.prefill_len - req.computed, self.prefill_chunk, budget)
            chunks.append((req, m))
            budget -= m
        while budget > 0 and self.waiting and len(self.running) + len(self.prefilling) < self.max_batch_size:
            req = self.waiting[0]
            if not self.allocate_prompt(req):
                break
            self.waiting.popleft()
            req.seq, self._admitted = self._admitted, self._admitted + 1
            if self.on_schedule is not None and not req.scheduled:
                self.on_schedule(req.id)
            req.scheduled = True
            self.prefilling.append(req)
            m = min(req.prefill_len - req.computed, self.prefill_chunk, budget)
            chunks.append((req, m))
            budget -= m
        return chunks

    def allocate_prompt(self, req: Request) -> bool:
        """Blocks for the positions ``req`` prefills: the cached blocks of its longest
        known prefix (at most all but the block of its last position, whose logits must
        be computed), then fresh ones; False (nothing taken) if they and one tree do not fit."""
        pool, bs = self.kv.pool, self.kv.block_size
        n = req.prefill_len
        tokens = (req.prompt + req.output)[:n]
        # a request capturing its tapped states needs them computed at every position
        keys = block_hashes(tokens, bs) if pool.caching and req.taps is None else []
        hits = pool.lookup(keys[:(n - 1) // bs])
        need = blocks_for(n + self.kv_room(req), bs) - len(hits)
        if need > pool.num_free - sum(1 for b in hits if pool.ref[b] == 0):
            return False
        pool.hold(hits)
        req.blocks = hits + pool.allocate(blocks_for(n, bs) - len(hits))
        req.keys = keys[:len(hits)]
        req.computed = len(hits) * bs
        self.prefix_cache_queries += n
        self.prefix_cache_hits += req.computed
        return True

    def cache_blocks(self, req: Request) -> None:
        """Key the request's blocks that became full of committed positions."""
        pool, bs = self.kv.pool, self.kv.block_size
        full = req.computed // bs
        if not pool.caching or len(req.keys) >= full:
            return
        done = len(req.keys)
        new = block_hashes((req.prompt + req.output)[:full * bs], bs, req.keys[-1] if done else b"", done)
        for i, key in enumerate(new, start=done):
            pool.register(req.blocks[i], key)
        req.keys += new

    def release(self, req: Request) -> None:
        """Free a request's blocks (cached ones stay findable until evicted)."""
        self.kv.pool.free(req.blocks)
        req.blocks = []
        if req in self.running:
            self.running.remove(req)
        else:
            self.prefilling.remove(req)

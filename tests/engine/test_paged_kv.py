"""Paged KV (#41): the block pool, admission and growth by free blocks, preemption by
recomputation, and the prefix cache. Losslessness holds through all of them: a request
decodes the same tokens whatever happened to its blocks."""

from __future__ import annotations

import pytest
import torch

from treespark import Budget
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.kv import BlockPool, block_hashes, blocks_for, bytes_per_token
from treespark.spec.params import SamplingParams


def run(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]], check=None):
    tokens = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if check is not None:
            check(engine)
    return tokens


def test_block_pool_allocates_frees_and_evicts_lru():
    pool = BlockPool(6, 4)
    assert pool.num_free == 5 and 0 not in pool.free_queue        # the null block is never handed out
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 2 and pool.blocks_in_use == 3
    keys = block_hashes(list(range(12)), 4)
    for b, k in zip(a, keys, strict=True):
        pool.register(b, k)
    pool.free(a)                                                  # cached, free, still findable
    assert pool.num_free == 5 and pool.blocks_in_use == 0
    assert pool.lookup(keys) == a
    pool.hold(a[:2])                                              # a hit takes them off the free queue
    assert pool.num_free == 3 and pool.ref[a[0]] == 1
    pool.free(a[:2])
    # tail blocks were freed first, so the next allocations evict the uncached, then a[2], ...
    got = pool.allocate(3)
    assert a[2] in got and pool.lookup(keys) == a[:2]
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([a[2]]); pool.free([a[2]])                      # noqa: E702
    # chain hashing: a block's key depends on its prefix
    assert block_hashes([9, 9, 9, 9], 4) != block_hashes([1, 1, 1, 1, 9, 9, 9, 9], 4)[1:]
    assert block_hashes([1, 2, 3], 4) == []                       # only full blocks


def preempting(pair, *, kv_blocks, budget):
    return Engine(pair, EngineConfig(max_batch_size=4, max_context=64, max_tree_nodes=4, block_size=4,
                                     kv_blocks=kv_blocks), budget=budget)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_that_outgrows_the_pool_is_preempted_and_resumes_exactly(pair64, temperature):
    """Three requests that together outgrow an 18-block pool: the newest is preempted
    (blocks freed, recomputed later, from the prefix cache where it can), and every
    request finishes with the tokens of an unconstrained run, greedy and seeded."""
    budget = Budget(0.0, 4, 2)
    reqs = [(f"r{i}", [i + 1, 5, 7, 11, 2, 3, 9, 8, 1, 4][: 6 + i], SamplingParams(
        temperature=temperature, max_tokens=36, seed=10 + i)) for i in range(3)]
    free = run(preempting(pair64, kv_blocks=0, budget=budget), reqs)
    tight = preempting(pair64, kv_blocks=18, budget=budget)
    peak = []
    got = run(tight, reqs, check=lambda e: peak.append(e.kv.blocks_in_use))
    assert tight.preemptions > 0 and max(peak) <= 18
    assert got == free
    assert tight.kv_rows_in_use == 0 and tight.kv.blocks_in_use == 0


def test_a_shared_prompt_prefix_is_computed_once(pair64):
    """The second request with a long shared prefix prefills only its uncached tail;
    its tokens equal a cold run's."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 64, (70,), generator=g).tolist()
    a, b = system + [1, 2, 3], system + [4, 5, 6, 7, 8]
    params = SamplingParams(max_tokens=8)
    cfg = EngineConfig(max_batch_size=2, max_context=128, block_size=16, prefill_chunk=32)
    engine = Engine(pair64, cfg, budget=Budget(0.0, 4, 2))
    run(engine, [("a", a, params)])
    before = engine.prefill_computed
    warm = run(engine, [("b", b, params)])
    cached = (len(system) // 16) * 16                              # 4 full blocks of the shared prefix
    assert engine.prefill_computed - before == len(b) - cached
    assert engine.prefix_cache_hits == cached and engine.prefix_cache_queries == len(a) + len(b)
    cold = run(Engine(pair64, cfg, budget=Budget(0.0, 4, 2)), [("b", b, params)])
    assert warm == cold
    off = Engine(pair64, EngineConfig(max_batch_size=2, max_context=128, prefix_caching=False))
    run(off, [("a", a, params), ("b", b, params)])
    assert off.prefix_cache_hits == 0 and off.prefill_computed == len(a) + len(b)


def keyed_blocks_are_committed(engine: Engine) -> None:
    """Every keyed block a live request holds lies wholly inside its committed positions,
    and its key is the chain hash of the tokens there."""
    bs, pool = engine.kv.block_size, engine.kv.pool
    for req in engine.sched.running + engine.sched.prefilling:
        keys = block_hashes((req.prompt + req.output)[:req.computed], bs)
        for i, blk in enumerate(req.blocks):
            if pool.key[blk] is not None:
                assert i < req.computed // bs, "a block holding uncommitted positions is keyed"
                assert pool.key[blk] == keys[i]
    for key, blk in pool.cached.items():
        assert pool.key[blk] == key


def test_no_block_holding_tree_tokens_is_ever_keyed(mimic16):
    """Trees of up to 12 nodes on 4-token blocks: tail blocks hold drafts every step,
    none is ever keyed or shared."""
    engine = Engine(mimic16, EngineConfig(max_batch_size=4, max_context=96, block_size=4),
                    budget=Budget(0.0, 12, 3))
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    engine.add_request("first", shared, SamplingParams(max_tokens=30))
    for _ in range(3):                                            # its prompt's blocks are committed
        engine.step()
        keyed_blocks_are_committed(engine)
    reqs = [(f"r{i}", shared + [i], SamplingParams(max_tokens=30 + i)) for i in range(3)]
    run(engine, reqs, check=keyed_blocks_are_committed)
    assert engine.prefix_cache_hits == 3 * 8


def test_a_running_request_holds_room_for_the_drafters_block(pair64):
    """The drafter's block pass writes its block's keys and values at a row's next
    positions in place (``treespark.models.drafter_blocks``): every step, each running
    request's blocks hold its context plus the block, even where its tree is smaller (a
    one-node chain verifies 2 tokens; the block is 4)."""
    engine = Engine(pair64, EngineConfig(max_batch_size=4, max_context=64, max_tree_nodes=4, block_size=4),
                    budget=Budget.chain(1))
    blk, bs = pair64.drafter.config.block_size, engine.kv.block_size
    assert blk > engine.budget.node_cap + 1 == 2   # the tree alone would leave the block short
    reserve, short = engine.sched.reserve_trees, []

    def reserved() -> None:
        reserve()
        short.extend(r.id for r in engine.sched.running if len(r.blocks) * bs < r.computed + blk)

    engine.sched.reserve_trees = reserved
    reqs = [(f"r{i}", [i + 1, 5, 7, 11, 2, 3, 9][: 3 + i], SamplingParams(max_tokens=20 + i)) for i in range(3)]
    run(engine, reqs)
    assert short == [] and engine.kv.blocks_in_use == 0


def test_blocks_hold_4x_the_requests_of_dense_rows_at_one_budget(pair64):
    """At the KV bytes of 4 dense rows (3 running + the prefill row, a full max_context
    and tree each), 300-token requests (200 prompt + 100 generated) held at once: rows
    hold 3, blocks hold >= 12."""
    cfg = dict(max_context=2048, max_tree_nodes=64, max_batch_size=32)
    probe = Engine(pair64, EngineConfig(**cfg, kv_blocks=blocks_for(2048 + 65, 16)))
    per_token = bytes_per_token(probe.runner.store_shape, probe.kv.drafter_shape, probe.runner.dtype)
    row_bytes = (2048 + 64 + 1) * per_token
    dense_rows = 4 * row_bytes // row_bytes - 1                   # the dense layout's rule (one staging row)
    engine = Engine(pair64, EngineConfig(**cfg, kv_budget_bytes=4 * row_bytes), budget=Budget.off())
    g = torch.Generator().manual_seed(0)
    reqs = [(f"r{i}", torch.randint(0, 64, (200,), generator=g).tolist(), SamplingParams(max_tokens=100))
            for i in range(16)]
    peak = []
    run(engine, reqs, check=lambda e: peak.append(e.kv_rows_in_use))
    assert max(peak) >= 4 * dense_rows and engine.preemptions == 0


def test_a_burst_is_prefilled_several_requests_per_forward(pair64):
    """Six 100-token prompts arriving at once, 64-token chunks, 256 tokens a step: every
    first token within 5 steps (one request's chunk a step took 12), and each request's
    tokens are those it gets alone."""
    from treespark import generate

    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(0, 64, (100,), generator=g).tolist() for _ in range(6)]
    budget = Budget(0.0, 4, 2)
    engine = Engine(pair64, EngineConfig(max_batch_size=8, max_context=160, prefill_chunk=64,
                                         max_num_batched_tokens=256), budget=budget)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6))
    first, tokens, step = {}, {str(i): [] for i in range(6)}, 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first.setdefault(out.request_id, step)
            tokens[out.request_id] += out.new_token_ids
    assert max(first.values()) <= 5
    for i, p in enumerate(ps):
        assert tokens[str(i)] == generate(pair64, p, max_new_tokens=6, budget=budget).token_ids

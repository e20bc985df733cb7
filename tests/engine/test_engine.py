"""The continuous-batching engine: equivalence, isolation across a batch, limits, leaks."""

from __future__ import annotations

import statistics

import pytest
import torch

from treespark import Budget, Calibration, generate
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.spec.params import SamplingParams, StepStats


def run(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
        abort_at: dict[int, list[str]] | None = None, max_steps: int = 10_000):
    """Step the engine; add requests at the given steps; collect tokens and finish reasons."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while step < max_steps and (engine.has_unfinished() or any(s >= step for s in arrivals)):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            tokens[rid] = []
        for rid in (abort_at or {}).get(step, []):
            engine.abort(rid)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    return tokens, reasons


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("budget", [Budget.adaptive(), Budget.chain(3), Budget(0.0, 16, 4)])
def test_batched_greedy_equals_generate_and_plain(mimic16, budget):
    ps = prompts(8, 16, seed=1)
    lengths = [5, 17, 9, 30, 2, 12, 21, 7]
    arrivals = {}
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        arrivals.setdefault(i // 2, []).append((f"r{i}", p, SamplingParams(max_tokens=n)))
    engine = Engine(mimic16, EngineConfig(max_batch_size=8, max_context=128, prefill_chunk=64), budget=budget)
    seen_batches = []
    engine.on_step = lambda s: seen_batches.append(s.batch_size)
    tokens, reasons = run(engine, arrivals)
    assert max(seen_batches) >= 4, "requests must actually share steps"
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        plain = generate(mimic16, p, max_new_tokens=n, budget=Budget.off()).token_ids
        assert tokens[f"r{i}"] == plain == generate(mimic16, p, max_new_tokens=n, budget=budget).token_ids
        assert reasons[f"r{i}"] == "length"


def test_sampled_request_is_identical_alone_and_in_a_batch(mimic16):
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=42)
    alone, _ = run(Engine(mimic16, EngineConfig(max_batch_size=4, max_context=64)),
                   {0: [("x", [1, 2, 3], params)]})
    others = [(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=15, seed=i))
              for i, p in enumerate(prompts(5, 16, seed=3))]
    batched, _ = run(Engine(mimic16, EngineConfig(max_batch_size=4, max_context=64)),
                     {0: others[:2], 1: [("x", [1, 2, 3], params)], 3: others[2:]})
    assert batched["x"] == alone["x"]
    assert alone["x"] == generate(mimic16, [1, 2, 3], max_new_tokens=20, temperature=0.9, seed=42).token_ids


def test_greedy_rows_between_sampled_rows_equal_plain_decoding(mimic16):
    """A batch mixing greedy and sampled rows, greedy ones at odd places: each greedy row
    is read back from its own place in the step's one copy."""
    ps = prompts(5, 16, seed=5)
    arrivals = {0: [(f"r{i}", p, SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=12, seed=i))
                    for i, p in enumerate(ps)]}
    engine = Engine(mimic16, EngineConfig(max_batch_size=5, max_context=64), budget=Budget(0.0, 16, 4))
    tokens, _ = run(engine, arrivals)
    for i in (1, 3):
        assert tokens[f"r{i}"] == generate(mimic16, ps[i], max_new_tokens=12, budget=Budget.off()).token_ids


def test_full_engine_queues_and_limits_refuse_up_front(pair64):
    engine = Engine(pair64, EngineConfig(max_batch_size=2, max_context=40))
    with pytest.raises(ValueError, match="max_context"):
        engine.add_request("long", list(range(30)), SamplingParams(max_tokens=11))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [1, 99], SamplingParams(max_tokens=2))
    arrivals = {0: [(f"q{i}", [i + 1, 2], SamplingParams(max_tokens=6)) for i in range(6)]}
    peak = []
    engine.on_step = lambda s: peak.append(s.batch_size)
    tokens, reasons = run(engine, arrivals)
    assert max(peak) == 2 and len(reasons) == 6 and all(len(t) == 6 for t in tokens.values())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1], SamplingParams(max_tokens=30))
        engine.add_request("dup", [1], SamplingParams(max_tokens=30))


def test_kv_budget_sets_the_blocks_and_admission(pair64):
    """A KV budget of 7 blocks (one request's worst case: max_context and the largest
    tree) admits requests by free blocks: several run at once, every request completes
    with the tokens it gets alone. Below one request's worst case the engine refuses to
    start, saying why."""
    block = Engine(pair64, EngineConfig(max_batch_size=1, max_context=40)).block_bytes
    engine = Engine(pair64, EngineConfig(max_batch_size=8, max_context=40, kv_budget_bytes=7 * block))
    assert engine.kv.pool.num_usable == 7
    arrivals = {0: [(f"q{i}", [i + 1, 2, 3], SamplingParams(max_tokens=5)) for i in range(5)]}
    peak = []
    engine.on_step = lambda s: peak.append(s.batch_size)
    tokens, reasons = run(engine, arrivals)
    assert 2 <= max(peak) < 5 and len(reasons) == 5
    alone, _ = run(Engine(pair64, EngineConfig(max_batch_size=1, max_context=40)), {0: arrivals[0][3:4]})
    assert tokens["q3"] == alone["q3"]
    with pytest.raises(ValueError, match="holds fewer than the 7 blocks"):
        Engine(pair64, EngineConfig(max_context=40, kv_budget_bytes=6 * block))
    assert Engine(pair64, EngineConfig(max_batch_size=4, max_context=40, kv_memory_fraction=0.5)).max_batch_size == 4


def test_no_leaks_after_200_requests_with_aborts(pair64):
    engine = Engine(pair64, EngineConfig(max_batch_size=6, max_context=64, prefill_chunk=8))
    arrivals, aborts = {}, {}
    for i, p in enumerate(prompts(200, 64, seed=5)):
        arrivals.setdefault(i // 3, []).append((f"r{i}", p, SamplingParams(max_tokens=1 + i % 13)))
        if i % 7 == 0:
            aborts.setdefault(i // 3 + 2, []).append(f"r{i}")
    tokens, reasons = run(engine, arrivals, aborts)
    assert len(reasons) == 200
    assert "abort" in reasons.values() and "length" in reasons.values()
    assert engine.kv_rows_in_use == 0 and engine.kv.blocks_in_use == 0
    assert not engine.has_unfinished() and engine.num_running == 0 and engine.num_waiting == 0
    assert not engine._ids


def test_abort_frees_the_row_at_once(pair64):
    engine = Engine(pair64, EngineConfig(max_batch_size=4, max_context=64))
    for i in range(3):
        engine.add_request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=40))
    for _ in range(5):
        engine.step()
    assert engine.kv_rows_in_use == 3
    engine.abort("r0")
    assert engine.kv_rows_in_use == 2 and engine.num_running == 2
    outs = engine.step()
    assert any(o.request_id == "r0" and o.finish_reason == "abort" for o in outs)


def test_budget_changes_between_steps_and_per_request(mimic16):
    engine = Engine(mimic16, EngineConfig(max_batch_size=4, max_context=128), budget=Budget(0.0, 12, 3))
    stats: list[StepStats] = []
    engine.on_step = stats.append
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=60))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=60), budget=Budget.chain(2))
    for _ in range(6):
        engine.step()
    engine.set_budget(Budget.off())
    for _ in range(4):
        engine.step()
    wide, off = stats[2:5], stats[-3:]
    assert all(s.tree_sizes[0] > 2 for s in wide) and all(s.tree_sizes[1] <= 2 for s in wide)
    assert all(s.tree_sizes[0] == 0 and s.tree_sizes[1] <= 2 for s in off)
    s = stats[-1]
    assert s.batch_size == 2 and s.tokens_verified == sum(s.tree_sizes) + 2 and s.verify_s > 0
    assert s.calibration_records and all(0 < q <= 1 and r >= 0 for q, _, r in s.calibration_records)
    # each row reports its own budget's node cap: the engine's one, or the request's
    assert all(s.node_caps == (12, 2) for s in wide) and all(s.node_caps == (0, 2) for s in off)


def test_records_are_split_by_temperature(mimic16):
    """Greedy rows' edge records and sampled rows' land apart (each regime has its own map)."""
    def records(temperature):
        engine = Engine(mimic16, EngineConfig(max_batch_size=1, max_context=64), budget=Budget(0.0, 8, 3))
        stats: list[StepStats] = []
        engine.on_step = stats.append
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=16, temperature=temperature, seed=1))
        while engine.has_unfinished():
            engine.step()
        return sum(len(s.calibration_records) for s in stats), sum(len(s.sampled_records) for s in stats)

    greedy, sampled = records(0.0), records(1.0)
    assert greedy[0] > 0 and greedy[1] == 0
    assert sampled[0] == 0 and sampled[1] > 0


def test_node_caps_are_clipped_to_max_tree_nodes(mimic16):
    engine = Engine(mimic16, EngineConfig(max_batch_size=2, max_context=64, max_tree_nodes=5),
                    budget=Budget(0.0, 40, 4))
    stats: list[StepStats] = []
    engine.on_step = stats.append
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20))
    for _ in range(3):
        engine.step()
    assert stats and all(s.node_caps == (5,) and s.tree_sizes[0] <= 5 for s in stats)


def test_sampled_drafts_are_drawn_at_the_calibrations_scale(pair64):
    """The sampled map's ``temperature_scale`` reaches the device drafting: a sharper
    drafting temperature puts the first children's q (the q each was drawn from, and is
    verified against) near 1, in the median (the mean read 0.93 on one machine: a
    child is still drawn from q, and one drawn at q = 0.01 pulls the mean down)."""
    def first_children_q(scale):
        cal = Calibration(1.0, 0.0, sampled=Calibration(1.0, 0.0, temperature_scale=scale))
        engine = Engine(pair64, EngineConfig(max_batch_size=1, max_context=64), budget=Budget(0.0, 8, 3),
                        calibration=cal)
        stats: list[StepStats] = []
        engine.on_step = stats.append
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=24, temperature=1.0, seed=1))
        while engine.has_unfinished():
            engine.step()
        q = [q for s in stats for q, _, rank in s.sampled_records if rank == 0]
        assert q
        return statistics.median(q)  # one child drawn at q = 0.01 must not swing it

    sharp, plain = first_children_q(0.05), first_children_q(1.0)
    assert sharp > 0.95 and plain < 0.5, (sharp, plain)


def test_the_block_head_runs_no_deeper_than_the_rows_may_draft(mimic16, monkeypatch):
    """A row drafts no deeper than its node cap: a batch of chains of 2 and 1 asks the
    drafter for two depths of base logits, not its whole block; plain rows, for none."""
    asked = []
    block_logits = type(mimic16.drafter).block_logits

    def spy(self, anchors, context, ctx_len, depths=None):
        asked.append(depths)
        return block_logits(self, anchors, context, ctx_len, depths)

    monkeypatch.setattr(type(mimic16.drafter), "block_logits", spy)
    assert mimic16.drafter.config.block_size > 2
    engine = Engine(mimic16, EngineConfig(max_batch_size=2, max_context=64), budget=Budget.off())
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=12), budget=Budget.chain(2))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=12), budget=Budget.chain(1))
    engine.add_request("c", [6], SamplingParams(max_tokens=12))
    tokens = {"a": [], "b": [], "c": []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert asked and max(asked) == 2   # (fewer as the requests near their max_tokens)
    for rid, p in (("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6])):
        assert tokens[rid] == generate(mimic16, p, max_new_tokens=12, budget=Budget.off()).token_ids


def test_a_plain_steps_round_is_its_roots_as_the_waves_make_it(mimic16, monkeypatch):
    """A step in which no row drafts (plain rows, rows at their last token) runs no
    backbone pass and no forest: its round is each row's root alone, field for field what
    the wave drafter makes of rows that draft nothing."""
    from treespark.spec.drafting import RoundDraft, RowDraft
    from treespark.spec.sampling import TorchSampler

    engine = Engine(mimic16, EngineConfig(max_batch_size=2, max_context=64), budget=Budget.off())
    rows = [RowDraft(root=t, budget=b, depth_limit=d, temperature=0.0, calibration=Calibration(1.0, 0.0),
                     sampler=TorchSampler(0)) for t, b, d in ((7, Budget.off(), 3), (9, Budget.chain(2), 0))]
    made, roots = engine.waves.draft(torch.zeros(2, 1, engine.waves.vocab), rows), RoundDraft.roots([7, 9])
    assert [(t.tokens, t.parents, t.depths, t.q, t.survival, t.children) for t in made.trees] == \
        [(t.tokens, t.parents, t.depths, t.q, t.survival, t.children) for t in roots.trees]
    assert (made.q_row_of, made.draft_ids, made.scores, made.waves, made.q_rows) == \
        (roots.q_row_of, roots.draft_ids, roots.scores, roots.waves, roots.q_rows)
    monkeypatch.setattr(engine.waves, "draft", lambda *a: pytest.fail("a plain step grew a forest"))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=2), budget=Budget.chain(3))  # its last token: no depth
    tokens = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for rid, p, n in (("a", [1, 2, 3], 6), ("b", [4, 5], 2)):
        assert tokens[rid] == generate(mimic16, p, max_new_tokens=n, budget=Budget.off()).token_ids


def test_a_bfloat16_drafter_scores_its_waves_on_w2_panels():
    """A drafter stored in bfloat16 (the shipped one) reads its Markov W2 from exact bfloat16
    panels: the same trees, step by step, as from its float32 copy, and greedy output
    equal to plain decoding."""
    from treespark import random_pair

    pair = random_pair(512, 3)
    with torch.no_grad():
        for p in pair.drafter.parameters():
            p.copy_(p.bfloat16().float())
    prompts = {"a": [5, 9, 2, 7], "b": [1, 3]}
    runs = {}
    for half in (True, False):
        engine = Engine(pair, EngineConfig(max_batch_size=2, max_context=96), budget=Budget(0.0, 8, 4))
        panels = engine.waves.w2_panels()
        assert panels is not None and panels.dtype == torch.bfloat16
        if half:
            on_panels = engine
        else:
            engine.waves.w2_panels = lambda: None
        sizes: list[tuple[int, ...]] = []
        engine.on_step = lambda s, sizes=sizes: sizes.append(s.tree_sizes)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        for rid, p in prompts.items():
            engine.add_request(rid, p, SamplingParams(max_tokens=20))
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        runs[half] = tokens, sizes
    assert runs[True] == runs[False] and any(sum(s) for s in runs[True][1])
    for rid, p in prompts.items():
        assert runs[True][0][rid] == generate(pair, p, max_new_tokens=20, budget=Budget.off()).token_ids
    # the panels follow the weight (a load or a training step in place)
    from treespark.kernels.native import to_panels

    w2 = pair.drafter.markov_head.markov_w2.weight
    with torch.no_grad():
        w2.mul_(2)
    assert torch.equal(on_panels.waves.w2_panels(), to_panels(w2.detach()))


def test_run_engine_runs_its_steps_and_only_them_inside_around(monkeypatch):
    """``run_engine(around=...)``: the engine is built before the context is entered (a
    profiler there sees the steps, not the construction), every step runs inside it."""
    from contextlib import contextmanager

    from treespark import random_pair
    from treespark.engine.run import run_engine

    pair = random_pair(512, 3)
    inside, built_inside, stepped_outside = [False], [], []
    real_init, real_step = Engine.__init__, Engine.step

    def init(self, *a, **kw):
        built_inside.append(inside[0])
        real_init(self, *a, **kw)

    def step(self):
        if not inside[0]:
            stepped_outside.append(1)
        return real_step(self)

    @contextmanager
    def around():
        inside[0] = True
        yield
        inside[0] = False

    monkeypatch.setattr(Engine, "__init__", init)
    monkeypatch.setattr(Engine, "step", step)
    r = run_engine(pair, [[1, 2, 3]], Budget.chain(2), max_tokens=6, batch_size=1, around=around)
    assert built_inside == [False] and not stepped_outside and r.steps > 0 and not inside[0]

"""The verify forward and the drafter's block pass padded to CUDA-graph buckets
(``treespark.engine.graphs``, ``treespark.engine.draft_graphs``), run eagerly on CPU over
the same static buffers a GPU replays: real rows get the plain passes' logits (and the
verify forward's keys), padding writes only the null block (the block pass writes no
store at all), the null block never reaches a real row, and the engine with
``cuda_graphs`` decodes what the eager engine decodes, greedy and sampled."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.engine.test_engine import prompts, run
from tests.engine.test_transfers import Watch
from treespark import Budget, generate, random_pair
from treespark.bench.attention import paged_scene, random_trees
from treespark.engine.attend import PagedContext
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.engine.draft_graphs import DraftInputs, GraphedDraft, draft_buckets
from treespark.engine.graphs import Buckets, BucketShape, GraphedForward, StaticInputs
from treespark.engine.kv import StoreShape
from treespark.engine.step_costs import measure_drafting, measure_verify
from treespark.engine.target import TargetRunner
from treespark.kernels import linear as linear_module
from treespark.kernels.linear import F_LINEAR, ProductPlan
from treespark.models.drafter_blocks import NativeBlockPass
from treespark.spec.params import SamplingParams
from treespark.spec.tree import tree_batch

BS = 16                       # KV block size
LENGTHS = [37, 5, 70]         # 3 rows (bucket 4); 9, 8, 7 nodes (bucket 16); 79 keys: 5 blocks (bucket 8)
BUCKETS = Buckets.up_to(8, 16, 16)
PLAN = ProductPlan.fixed(F_LINEAR)


@pytest.fixture(scope="module")
def pairs():
    return {"qwen3": random_pair(151_936, 0, block_size=5, markov_rank=16, family="qwen3"),
            "llama": random_pair(512, 0)}


def _scene(pair, seed=3):
    runner = TargetRunner(pair.target, pair.drafter.config.target_layer_ids, PLAN)
    c = pair.drafter.config
    scene = paged_scene(runner, StoreShape(c.num_hidden_layers, c.num_key_value_heads, c.head_dim), LENGTHS,
                        nodes=9, block_size=BS, seed=seed)
    return runner, scene


def _forward(runner, scene, graphed: GraphedForward | None, trees=None, lengths=None):
    """One verify forward of the scene's trees (or ``trees`` after ``lengths``), plain or
    padded: (logits [B, K, V], taps)."""
    b = tree_batch(trees or scene.trees, lengths or scene.lengths, runner.device)
    rows = scene.kv.rows(scene.table, b.mask.shape[-1])
    if graphed is None:
        out = runner.forward(b.tokens, b.positions, b.write_pos, scene.kv.target, rows, b.mask)
    else:
        out = graphed.forward(b.tokens, b.positions, b.write_pos, rows, b.mask)
    return out.logits, out.taps


def test_buckets_pad_each_axis_to_a_power_of_two_or_its_largest_shape():
    buckets = Buckets.up_to(5, 33, 8)
    assert buckets.rows == (1, 2, 4, 5) and buckets.tokens == (1, 2, 4, 8, 16, 32, 33)
    assert buckets.blocks == (1, 2, 4, 8) and Buckets.up_to(1, 1, 1).rows == (1,)
    assert buckets.shape(3, 9, 5) == BucketShape(4, 16, 8)
    assert buckets.shape(5, 33, 6) == BucketShape(5, 33, 8)
    assert buckets.shape(4, 16, 8) == BucketShape(4, 16, 8)        # on a bucket: no padding
    assert buckets.shape(6, 1, 1) is None and buckets.shape(1, 34, 1) is None and buckets.shape(1, 1, 9) is None


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_padded_forward_gives_the_plain_forward_on_real_rows(pairs, family):
    """B, K and nb all off a bucket (3 -> 4 rows, 9 -> 16 tokens, 5 -> 8 blocks); then a
    second batch of the same bucket through the same buffers, as a replay would read it."""
    pair = pairs[family]
    runner, plain_scene = _scene(pair)
    _, scene = _scene(pair)
    graphed = GraphedForward(runner, scene.kv.target, BS, BUCKETS, capture=False)
    second = [30, 3, 64]
    batches = [(None, None), (random_trees(second, 12, runner.vocab_size, np.random.default_rng(1)), second)]
    for trees, lengths in batches:
        ref, ref_taps = _forward(runner, plain_scene, None, trees, lengths)
        got, got_taps = _forward(runner, scene, graphed, trees, lengths)
        # bit for bit on CPU: padding adds rows to each product and masked keys to attention,
        # neither changes a real row's sums (the LM head runs on the real rows alone)
        assert torch.equal(got, ref) and torch.equal(got_taps, ref_taps)
        # every real slot holds what the plain forward wrote; padding wrote the null block only
        assert torch.equal(scene.kv.target.k[:, BS:], plain_scene.kv.target.k[:, BS:])
        assert torch.equal(scene.kv.target.v[:, BS:], plain_scene.kv.target.v[:, BS:])
    assert graphed.shapes == {BucketShape(4, 16, 8)}
    assert bool(scene.kv.target.k[:, :BS].abs().sum() > 0)  # the padding's keys went there


def _fill_null_block(store) -> None:
    """Large random keys and values in the null block (block 0) of ``store``, every layer."""
    g = torch.Generator().manual_seed(9)
    for t in (store.k, store.v):
        t[:, :BS] = 50.0 * torch.randn(t[:, :BS].shape, generator=g)


def test_the_null_block_never_reaches_a_real_row(pairs):
    """Garbage in the null block (block 0: padding's slots and table columns) changes no
    real row's logits, bit for bit."""
    pair = pairs["qwen3"]
    out = []
    for garbage in (False, True):
        runner, scene = _scene(pair)
        if garbage:
            _fill_null_block(scene.kv.target)
        graphed = GraphedForward(runner, scene.kv.target, BS, BUCKETS, capture=False)
        out.append(_forward(runner, scene, graphed)[0])
    assert torch.isfinite(out[1]).all()
    assert torch.equal(out[0], out[1])


def test_a_smaller_fill_resets_the_padding_a_larger_one_left():
    inputs = StaticInputs.empty(BucketShape(4, 8, 4), BS, torch.device("cpu"))
    big = torch.full((4, 8), 7)
    inputs.fill(big, big, big, torch.full((4, 4), 3), torch.ones(4, 1, 8, 64, dtype=torch.bool))
    small = torch.full((2, 3), 5)
    mask = torch.ones(2, 1, 3, 20, dtype=torch.bool)
    inputs.fill(small, small, small, torch.full((2, 2), 2), mask)
    for buf in (inputs.tokens, inputs.positions, inputs.slots):
        assert torch.equal(buf[:2, :3], small) and int(buf.sum()) == 5 * 6   # padding: token 0, slot 0
    assert int(inputs.table.sum()) == 2 * 4                                 # the null block elsewhere
    assert torch.equal(inputs.mask[:2, :, :3, :20], mask) and not inputs.mask[:2, :, :3, 20:].any()
    pad = torch.ones(4, 1, 8, dtype=torch.bool)
    pad[:2, :, :3] = False
    assert torch.equal(inputs.mask[..., 0], torch.ones(4, 1, 8, dtype=torch.bool))   # every query sees a key
    assert not inputs.mask[..., 1:][pad].any()                              # a padding query: key 0 only


def test_the_padded_forward_takes_nothing_from_the_host(pairs):
    """What a GPU captures must not build tensors from host data or move any: the padded
    forward and block pass (their copies into the static buffers, the layers, the LM
    heads) make no such call, where a stray one would be seen (``Watch``)."""
    pair = pairs["llama"]
    runner, scene = _scene(pair)
    graphed = GraphedForward(runner, scene.kv.target, BS, BUCKETS, capture=False)
    b = tree_batch(scene.trees, scene.lengths, runner.device)
    rows = scene.kv.rows(scene.table, b.mask.shape[-1])
    drafted = GraphedDraft(pair.drafter, scene.kv.drafter, BS, DRAFT_BUCKETS)
    anchors, lens = _draft_inputs(scene)
    context = PagedContext(scene.kv.drafter, scene.table, BS, max(scene.lengths))
    resident = [*pair.target.parameters(), *pair.target.buffers(), *pair.drafter.parameters(),
                *pair.drafter.buffers()]
    with Watch(resident) as w:
        graphed.forward(b.tokens, b.positions, b.write_pos, rows, b.mask)
        drafted.block_logits(anchors, context, lens)
    assert not w.outside and w.uploads == w.fetches == 0
    assert drafted.shapes == {BucketShape(4, 5, 8)}


def test_a_shape_above_the_largest_bucket_runs_the_plain_forward(pairs):
    pair = pairs["llama"]
    runner, plain_scene = _scene(pair)
    _, scene = _scene(pair)
    graphed = GraphedForward(runner, scene.kv.target, BS, Buckets.up_to(2, 16, 8), capture=False)
    got, _ = _forward(runner, scene, graphed)
    assert torch.equal(got, _forward(runner, plain_scene, None)[0]) and not graphed.shapes


# -- the drafter's block pass -------------------------------------------------------------
DRAFT_BUCKETS = draft_buckets(8, 5, 200, BS)   # rows 1 .. 8; the qwen3 drafter's block of 5; 1 .. 16 blocks


def _draft_inputs(scene, lengths=None, anchors=None):
    lengths = lengths or scene.lengths
    anchors = anchors or [t.tokens[0] for t in scene.trees]
    return torch.tensor(anchors), torch.tensor(lengths)


def _block(pair, scene, graphed: GraphedDraft | None, lengths=None, anchors=None, table=None):
    """The block pass over the scene's drafter store (``lengths`` and ``anchors`` for
    another batch over the same blocks), plain or padded: [B, block, Vd]."""
    a, lens = _draft_inputs(scene, lengths, anchors)
    table = scene.table if table is None else table
    context = PagedContext(scene.kv.drafter, table, BS, int(lens.max()))
    drafter = pair.drafter if graphed is None else graphed
    return drafter.block_logits(a, context, lens)


def test_draft_buckets_pad_rows_and_table_columns_the_block_fixed():
    buckets = draft_buckets(6, 7, 100, BS)            # contexts up to 100 tokens + the block: 7 blocks
    assert buckets.rows == (1, 2, 4, 6) and buckets.tokens == (7,) and buckets.blocks == (1, 2, 4, 7)
    assert buckets.shape(3, 7, 5) == BucketShape(4, 7, 7) and buckets.shape(7, 7, 1) is None


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_padded_block_pass_gives_the_plain_block_logits_on_real_rows(pairs, family, monkeypatch):
    """Rows and table columns off a bucket (3 -> 4 rows; 75 keys, 5 -> 8 blocks), then a
    second batch through the same buffers (a replay's new inputs: other anchors and
    lengths), then a narrower table (3 -> 4 blocks) and one row alone (3 -> 4 blocks);
    real rows bit for bit the plain pass's (qwen3: at the full 151,936-token vocabulary),
    and the drafter's store untouched. Both on torch's operators, as on a GPU: on the CPU
    a pass of at most 16 rows runs the native kernels, which padding can take it past."""
    monkeypatch.setattr(NativeBlockPass, "runs", lambda self, x: False)
    monkeypatch.setattr(linear_module, "on_native", lambda x, weight: False)
    pair = pairs[family]
    _, scene = _scene(pair)
    k0, v0 = scene.kv.drafter.k.clone(), scene.kv.drafter.v.clone()
    graphed = GraphedDraft(pair.drafter, scene.kv.drafter, BS, DRAFT_BUCKETS, capture=False)
    v = pair.drafter.config.draft_vocab
    batches = [(None, None, None), ([30, 3, 64], [7, 8, 9], None), ([33, 4, 41], [1, 2, 3], scene.table[:, :4]),
               ([30], [5], scene.table[2:3])]
    for lengths, anchors, table in batches:
        ref = _block(pair, scene, None, lengths, anchors, table)
        got = _block(pair, scene, graphed, lengths, anchors, table)
        assert got.shape == ref.shape and got.shape[-1] == v
        assert torch.equal(got, ref)
    assert graphed.shapes == {BucketShape(4, 5, 8), BucketShape(4, 5, 4), BucketShape(1, 5, 4)}
    assert torch.equal(scene.kv.drafter.k, k0) and torch.equal(scene.kv.drafter.v, v0)


def test_the_null_block_never_reaches_a_real_rows_draft(pairs):
    """Garbage in the drafter's null block (padding rows' whole table, real rows' padded
    columns) changes no real row's block logits, bit for bit."""
    pair = pairs["qwen3"]
    out = []
    for garbage in (False, True):
        _, scene = _scene(pair)
        if garbage:
            _fill_null_block(scene.kv.drafter)
        graphed = GraphedDraft(pair.drafter, scene.kv.drafter, BS, DRAFT_BUCKETS, capture=False)
        out.append(_block(pair, scene, graphed))
    assert torch.isfinite(out[1]).all()
    assert torch.equal(out[0], out[1])
    # the padding row too reads only its own block: finite over the garbage (the whole padded pass)
    (shape,) = graphed.shapes
    assert shape.rows == 4 and torch.isfinite(graphed.body(graphed._inputs(shape, DraftInputs.empty))).all()


def test_a_smaller_draft_fill_resets_the_padding_a_larger_one_left():
    inputs = DraftInputs.empty(BucketShape(4, 5, 4), torch.device("cpu"))
    inputs.fill(torch.full((4,), 7), torch.full((4,), 9), torch.full((4, 4), 3))
    inputs.fill(torch.tensor([5, 6]), torch.tensor([1, 2]), torch.full((2, 3), 2))
    assert inputs.anchors.tolist() == [5, 6, 0, 0] and inputs.lengths.tolist() == [1, 2, 0, 0]
    assert int(inputs.table.sum()) == 2 * 6 and not inputs.table[:, 3:].any() and not inputs.table[2:].any()


def test_a_block_pass_above_the_largest_bucket_runs_the_plain_pass(pairs):
    pair = pairs["qwen3"]
    _, scene = _scene(pair)
    graphed = GraphedDraft(pair.drafter, scene.kv.drafter, BS, draft_buckets(2, 5, 200, BS), capture=False)
    assert torch.equal(_block(pair, scene, graphed), _block(pair, scene, None)) and not graphed.shapes


def _engine(pair, budget, graphs: bool, rows: int = 4) -> Engine:
    return Engine(pair, EngineConfig(max_batch_size=rows, max_context=128, prefill_chunk=64, cuda_graphs=graphs,
                                     cuda_graphs_draft=graphs), budget=budget, products=PLAN)


def test_cuda_graphs_off_cuda_warns_once_and_runs_padded(mimic16):
    with pytest.warns(UserWarning, match="nothing to capture") as caught:
        engine = _engine(mimic16, Budget(0.0, 8, 3), True)
    assert sum("cuda_graphs" in str(w.message) for w in caught) == 1
    assert engine.graphs is not None and not engine.graphs.capture
    assert engine.draft_graphs is not None and not engine.draft_graphs.capture
    assert engine.graph_captures == 0


@pytest.mark.parametrize("budget", [Budget.off(), Budget(0.0, 16, 4)])
def test_graphed_engine_greedy_equals_plain_decoding(mimic16, budget):
    ps, lengths = prompts(4, 16, seed=1), [5, 12, 9, 2]
    arrivals = {}
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        arrivals.setdefault(i // 2, []).append((f"r{i}", p, SamplingParams(max_tokens=n)))
    with pytest.warns(UserWarning):
        engine = _engine(mimic16, budget, True)
    tokens, _ = run(engine, arrivals)
    assert len(engine.graphs.shapes) > 1, "the batch and its trees must cross buckets"
    # the block pass ran from its buckets wherever the engine drafted: batches of 1 to 4 rows
    assert {s.rows for s in engine.draft_graphs.shapes} == (set() if budget.is_off else {1, 2, 4})
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        assert tokens[f"r{i}"] == generate(mimic16, p, max_new_tokens=n, budget=Budget.off()).token_ids


def test_graphed_engine_samples_what_the_eager_engine_samples(mimic16):
    """The same seeds give the same tokens: a tree's walk at T > 0 reads the padded
    forward's logits exactly where it reads the plain one's."""
    arrivals = {}
    for i, p in enumerate(prompts(4, 16, seed=4)):
        params = SamplingParams(temperature=0.6 + 0.2 * (i % 3), max_tokens=10, seed=i)
        arrivals.setdefault(i // 2, []).append((f"s{i}", p, params))
    with pytest.warns(UserWarning):
        engine = _engine(mimic16, Budget(0.0, 8, 3), True)
    graphed, _ = run(engine, arrivals)
    eager, _ = run(_engine(mimic16, Budget(0.0, 8, 3), False), arrivals)
    assert graphed == eager and all(len(t) == 10 for t in eager.values())
    assert len(engine.draft_graphs.shapes) > 1   # the drafts came from the padded block pass


def test_the_step_cost_table_times_the_graphed_forward(mimic16):
    with pytest.warns(UserWarning):
        engine = _engine(mimic16, Budget(0.0, 8, 3), True)
    measure_verify(engine, (1, 2), (1, 4, 9), deadline=time.perf_counter() - 1, context=16)
    # 16 + k keys: two blocks; 9 tokens pad to 16
    assert engine.graphs.shapes == {BucketShape(b, k, 2) for b in (1, 2) for k in (1, 4, 16)}


def test_the_step_cost_table_times_the_graphed_block_pass(mimic16):
    """The drafting costs come from engine steps, which draft through the padded pass."""
    with pytest.warns(UserWarning):
        engine = _engine(mimic16, Budget(0.0, 8, 3), True)
    verify = measure_verify(engine, (1,), (1, 4, 9), deadline=time.perf_counter() - 1, context=16)
    m = measure_drafting(engine, verify, deadline=time.perf_counter() - 1)
    # one and four rows always run (past the deadline too), their tails at fewer
    assert {1, 4} <= {s.rows for s in engine.draft_graphs.shapes} <= {1, 2, 3, 4}
    assert m.draft is not None and m.draft.batch_sizes[0] == 1 and min(m.host_node_s, m.step_base_s, m.step_row_s) >= 0.0

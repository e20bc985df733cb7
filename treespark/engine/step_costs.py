"""A replica's step-cost table, measured at startup (or read from a cache): what the
per-step allocation (``treespark.engine.step_alloc``) prices every step on.

``startup_step_costs(engine)``:

1. looks for a cached table under a *fingerprint* of the hardware, the model pair, the
   dtype, the threads and the product plan (``fingerprint``): the same replica on the same machine starts
   in milliseconds, and a replica on other hardware measures its own;
2. otherwise measures, in at most ``time_budget_s`` (20 s by default):
   * the verify forward ``T(bs, k)`` on a grid (``GRID_TOKENS``; each cell the fastest of a
     few forwards over the engine's paged store, on the path a served step takes,
     ``treespark.engine.cost_measure.time_paged_forward``; cells past the budget or above
     ``max_step_tokens`` are extrapolated along k);
   * drafting and host costs, from real engine steps on a few synthetic requests under
     fixed budgets at one and four rows at least (the drafting the engine serves with: with
     ``cuda_graphs``, the block pass replayed from its graphs; steps that captured one are
     left out): drafting's seconds by rows and node cap (``DRAFT_CAPS``, a ``CostModel``:
     each cell the mean of its faster half of steps), the host seconds per verified draft
     node beyond the forward (the slope of ``verify_s - T`` on the nodes), and a plain step's time beyond
     its forward by rows (scheduling, sampling, the commit, the drafter's context: ~5 ms
     of a ~18 ms step at one row on a two-core EPYC), added to every verify cell
     (``with_step_work``): the table prices steps, not forwards;
   A replica measures as it starts, beside Ray's own processes and its neighbours starting:
   other work only ever adds to a timing, so the fastest timings are the step's own. (In a
   starting service the verify forward at one row then reads ~25 % above one process's
   and two tokens ~40 % above: so do served steps, and the table keeps it. Before four
   rows always ran, a service's fit saw one row only and split drafting evenly between
   step and row: 5.3 + 5.3 ms a row, ~90 ms at 16 rows against ~27 measured. A fit of
   ``base + row * bs + node * nodes`` to chain-4 and 16-node trees priced a one-node draft
   at 6.1 ms against 3.5 measured: drafting's time follows its waves, so its cap.);
3. stores it (a ``filelock`` guards the cache file: two replicas starting together on
   one machine measure once each at worst, and never leave a torn file).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treespark.engine.cost_measure import time_graphed_forward, time_paged_forward
from treespark.kernels.machine import hardware_name, read_cached, write_cached
from treespark.pricing.allocate import StepCosts
from treespark.pricing.costmodel import CostModel, interp, monotone
from treespark.spec.budget import DEFAULT_BRANCH_CAP, Budget
from treespark.spec.params import SamplingParams, StepStats

CACHE_DIR = Path.home() / ".cache" / "treespark" / "step-costs"
VERSION = 11  # raised whenever what a table measures changes (11: drafting on full-depth steps only): an older cached one is measured again


@dataclass(frozen=True)
class StepCostTable:
    """What a replica measured: the verify table and the drafting and host costs."""

    verify: CostModel          # a step's verify forward and its fixed work beyond it (``with_step_work``)
    draft: CostModel | None    # a drafting step's drafting seconds by (rows, node cap); None: nothing drafted
    host_node_s: float
    fingerprint: str
    measured_s: float          # seconds the measurement took (0 when read from the cache)
    source: str                # "measured" or "cache"
    step_base_s: float = 0.0   # that fixed work, in ``verify`` already: base + row * rows
    step_row_s: float = 0.0

    def step_costs(self, max_nodes: int) -> StepCosts:
        return StepCosts(self.verify, node_s=self.host_node_s, max_nodes=max_nodes, draft=self.draft)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["verify"], d["draft"] = self.verify.to_json(), None if self.draft is None else self.draft.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepCostTable:
        draft = None if d["draft"] is None else CostModel.from_json(d["draft"])
        return cls(**{**d, "verify": CostModel.from_json(d["verify"]), "draft": draft})


def fingerprint(engine, grid: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    """Hardware + model + dtype + threads + grid + product plan + native kernels' build +
    attention path + compile backend + CUDA graphs, hashed: the cache key (a kernel change
    re-measures the table, as it re-times the plan)."""
    from treespark.kernels import native

    pair = engine.pair
    n_target = sum(p.numel() for p in pair.target.parameters())
    n_drafter = sum(p.numel() for p in pair.drafter.parameters())
    key = {"v": VERSION, "hw": hardware_name(), "device": str(engine.device), "dtype": str(engine.runner.dtype),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "pair": pair.name,
           "params": [n_target, n_drafter], "vocab": engine.vocab_size, "grid": grid,
           "max_batch": engine.config.max_batch_size,
           "products": engine.runner.products_described, "attention": engine.config.attention.value,
           "kernels": native.build_id(),
           "compile": engine.config.compile_backend, "graphs": engine.config.cuda_graphs,
           "draft_graphs": engine.config.cuda_graphs_draft}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


# tokens per row the verify grid times: dense where steps are small, since on CPU the
# time of a few-row forward jumps where the product kernel changes (3 -> 4 rows on one
# machine: +38 %, docs/benchmarks/forward.md), and interpolating over such a jump misprices
# every step between two cells
GRID_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _grid(engine) -> tuple[tuple[int, ...], tuple[int, ...]]:
    b = engine.config.max_batch_size
    bs = tuple(sorted({x for x in (1, 2, 4, 8, 16, 32) if x < b} | {b}))
    kmax = engine.config.max_tree_nodes + 1
    ks = tuple(sorted({x for x in GRID_TOKENS if x < kmax} | {kmax}))
    return bs, ks


def isotonic(ys: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to ``ys`` in least squares (pool adjacent
    violators): one slow timing is averaged with its neighbours, not carried to every
    larger cell as a running maximum would."""
    blocks: list[list[float]] = []            # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]


def measure_verify(engine, batch_sizes, tokens, *, deadline: float, max_passes: int = 7,
                   context: int = 128, max_step_tokens: int = 128) -> CostModel:
    """T(bs, k): passes over the grid, each cell timed once per pass (a burst of load
    from another process spoils one pass of a few cells, not every timing of one cell),
    more passes while ``deadline`` (a perf_counter time) allows (the first always runs
    whole; later ones stop at the deadline, cell by cell); each cell its fastest timing
    (other processes only ever add to one),
    made non-decreasing in k and bs (``isotonic``). Cells above ``max_step_tokens`` are
    extrapolated along k. Timed: the forward the engine verifies with, over its paged
    store (``time_paged_forward``; with ``cuda_graphs`` the replayed one,
    ``time_graphed_forward``), over ``context`` committed tokens a row, or the engine's
    ``max_context`` where that is shorter (a forward holds no position past it and its
    trees: the rotary table ends there)."""
    context = min(context, engine.config.max_context)
    runner = engine.runner
    g = torch.Generator().manual_seed(0)
    if engine.graphs is None:
        def timed(b: int, k: int, warmup: bool) -> float:
            return time_paged_forward(runner, engine.kv, b, k, context, 1, g, warmup=warmup)
    else:
        def timed(b: int, k: int, warmup: bool) -> float:
            return time_graphed_forward(engine.graphs, engine.kv, b, k, context, 1, g, warmup=warmup)
    cells = [(b, k) for b in batch_sizes for k in tokens if b * k <= max_step_tokens or k <= 2]
    times: dict[tuple[int, int], list[float]] = {}
    for p in range(max_passes):
        for b, k in cells:
            if p and time.perf_counter() > deadline:
                break
            times.setdefault((b, k), []).append(timed(b, k, p == 0))
    table = {c: min(ts) for c, ts in times.items()}
    seconds = []
    for b in batch_sizes:
        have = [k for k in tokens if (b, k) in table]
        xs, ys = have, isotonic([table[(b, k)] for k in have])
        seconds.append([max(interp(xs, ys, k), ys[-1]) if k > have[-1] else interp(xs, ys, k) for k in tokens])
    for j in range(len(tokens)):                 # and along the batch
        col = isotonic([row[j] for row in seconds])
        for i, row in enumerate(seconds):
            row[j] = col[i]
    return measured_table(engine, batch_sizes, tokens, seconds, context=context)


def measured_table(engine, batch_sizes, tokens, seconds, **kw: Any) -> CostModel:
    """A ``CostModel`` of seconds timed on ``engine`` now (made non-decreasing, ``monotone``),
    stamped with its pair, device, threads and time."""
    return CostModel(tuple(batch_sizes), tuple(tokens), monotone(seconds), pair=engine.pair.name,
                     device=str(engine.device), threads=torch.get_num_threads(),
                     created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **kw)


def lower_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares coefficients of ``y ~ x`` fitted to the points on or below a first
    least-squares fit (the faster half of timed steps: another process's work only ever
    adds to a step's time, so the slow half carries the neighbours, not the step), each
    clamped at 0. Fewer than ``2 * x.shape[1]`` points below the first fit: the first fit."""
    c, *_ = np.linalg.lstsq(x, y, rcond=None)
    below = y <= x @ c
    if below.sum() >= 2 * x.shape[1]:
        c, *_ = np.linalg.lstsq(x[below], y[below], rcond=None)
    return np.maximum(c, 0.0)


ONE_ROW_TOKENS = 16  # tokens of each one-row request: the steps that always run (~15 a budget)
DRAFT_CAPS = (1, 2, 4, 8, 16, 32)   # node caps the drafting table times (and the engine's largest)


@dataclass(frozen=True)
class MeasuredSteps:
    """What ``measure_drafting`` finds in engine steps, in seconds."""

    draft: CostModel | None   # a drafting step's drafting by (rows, node cap) (``drafting_table``)
    host_node_s: float    # the verify stage's host work per verified draft node, beyond the forward
    step_base_s: float    # a plain step beyond its forward (scheduling, sampling, the commit,
    step_row_s: float     # the drafter's context): base + row * rows


def with_step_work(verify: CostModel, step_base_s: float, step_row_s: float) -> CostModel:
    """The verify table with a step's fixed work beyond the forward added to every cell
    (``step_base_s + step_row_s * bs``): what a step costs, which the allocation weighs
    tokens against. Without it a plain step reads cheaper than it is, and every node
    drafted dearer."""
    return replace(verify, seconds=tuple(tuple(t + step_base_s + step_row_s * b for t in row)
                                         for b, row in zip(verify.batch_sizes, verify.seconds, strict=True)))


def faster_half(ys: list[float]) -> float:
    """The mean of the faster half of timings of one thing (``lower_fit`` on a constant)."""
    return float(lower_fit(np.ones((len(ys), 1)), np.asarray(ys, dtype=np.float64))[0])


def drafting_table(engine, points: dict[tuple[int, int], list[float]], rows: list[int],
                   caps: tuple[int, ...]) -> CostModel | None:
    """The drafting ``CostModel`` from drafting seconds per (rows, node cap): every row
    count with each cap timed (one and four rows always are), each cell its faster half
    (``faster_half``), non-decreasing in cap and rows; None where no row count has every cap
    (an engine that drafts nothing)."""
    have = [b for b in rows if all(points.get((b, c)) for c in caps)]
    if not have:
        return None
    return measured_table(engine, have, caps, [[faster_half(points[(b, c)]) for c in caps] for b in have])


def measure_drafting(engine, verify: CostModel, *, deadline: float, seed: int = 0) -> MeasuredSteps:
    """Drafting, host and step costs (``MeasuredSteps``) from engine steps on
    synthetic requests (random prompts) under a tree budget of each cap in ``DRAFT_CAPS``
    and plain decoding: one row (``ONE_ROW_TOKENS`` steps a budget) and four always
    (without two batch sizes the cost per row cannot be told from the cost per step),
    the largest batch while ``deadline`` allows; drafting tabled by ``drafting_table``, the
    rest fitted by ``lower_fit``: the plain steps' time beyond ``verify``'s forward, by
    rows (``with_step_work``). The steps draft and verify as the engine serves (with
    ``cuda_graphs``, from the replayed passes); a step that captured a CUDA graph (its
    warm-up and capture: once per bucket) is left out."""
    steps: list[tuple[StepStats, int | None]] = []   # each with the graphs captured by its end
    before = engine.graph_captures
    prev_hook, prev_alloc = engine.on_step, engine.allocator
    engine.on_step, engine.allocator = lambda s: steps.append((s, engine.graph_captures)), None
    g = torch.Generator().manual_seed(seed)
    top = engine.config.max_tree_nodes
    block = engine.drafter.config.block_size
    caps = tuple(sorted({c for c in DRAFT_CAPS if c < top} | {top})) if top > 0 else (1,)
    try:
        always = min(4, engine.config.max_batch_size)
        rows = sorted({1, always, engine.config.max_batch_size})
        budgets = [Budget(0.0, c, DEFAULT_BRANCH_CAP) for c in caps] + [Budget.off()]
        for bs in rows:
            for budget in budgets:
                if time.perf_counter() > deadline and bs > always:
                    break  # one and four rows under each budget always run: enough for a table
                n = ONE_ROW_TOKENS if bs == 1 else 8
                for i in range(bs):
                    prompt = torch.randint(0, engine.vocab_size, (24,), generator=g).tolist()
                    # room for a full block past n tokens: no timed step drafts under a depth
                    # limit cut by the tokens left (a request's last steps draft shallow
                    # trees, and their faster half priced a served step's drafting at half)
                    engine.add_request(f"__costs-{bs}-{budget.node_cap}-{i}", prompt,
                                       SamplingParams(max_tokens=n + block + 1), budget=budget)
                while engine.has_unfinished():
                    engine.step()
                    for req in [r for r in engine.sched.running if len(r.output) >= n]:
                        engine.abort(req.id)
    finally:
        engine.on_step, engine.allocator = prev_hook, prev_alloc
    ends = [before] + [c for _, c in steps]
    decode = [s for (s, c), start in zip(steps, ends, strict=False) if s.prefill_tokens == 0 and c == start]
    points: dict[tuple[int, int], list[float]] = {}
    for s in decode:
        if s.draft_waves > 0:
            points.setdefault((s.batch_size, max(s.node_caps)), []).append(s.draft_s)
    draft = drafting_table(engine, points, rows, caps)
    # host seconds per verified draft node: the slope of (verify stage - forward) on the
    # draft nodes (a plain step's host work is per step, not per node)
    host = 0.0
    pts = [(sum(s.tree_sizes), s.verify_s - verify.time(s.batch_size, max(s.tree_sizes) + 1)) for s in decode]
    if len({n for n, _ in pts}) > 1:
        host = float(lower_fit(np.array([[1.0, n] for n, _ in pts]), np.array([r for _, r in pts]))[1])
    # a plain step beyond its forward, by rows (one and four rows always ran plain steps; an
    # engine of one row: that row's, the same for every step)
    step_base = step_row = 0.0
    plain = [(s.batch_size, s.step_s - verify.time(s.batch_size, 1)) for s in decode
             if s.draft_waves == 0 and max(s.tree_sizes, default=0) == 0]
    if len({b for b, _ in plain}) > 1:
        step_base, step_row = (float(v) for v in lower_fit(np.array([[1.0, b] for b, _ in plain]),
                                                             np.array([y for _, y in plain])))
    elif plain:
        step_base = faster_half([y for _, y in plain])
    return MeasuredSteps(draft, host, step_base, step_row)


def startup_step_costs(engine, *, time_budget_s: float = 20.0, cache_dir: Path | None = CACHE_DIR) -> StepCostTable:
    """The replica's table: from the cache when its fingerprint is there, else measured
    (and cached). ``cache_dir`` None: always measure, store nothing."""
    grid = _grid(engine)
    fp = fingerprint(engine, grid)
    path = None if cache_dir is None else Path(cache_dir) / f"{fp}.json"
    cached = None if path is None else read_cached(path)
    if cached is not None:
        try:
            return StepCostTable.from_json({**cached, "source": "cache", "measured_s": 0.0})
        except (ValueError, KeyError, TypeError):
            pass  # a table of an older layout: measure again
    t0 = time.perf_counter()
    deadline = t0 + 0.6 * time_budget_s
    forward = measure_verify(engine, *grid, deadline=deadline)
    m = measure_drafting(engine, forward, deadline=t0 + 0.95 * time_budget_s)
    table = StepCostTable(with_step_work(forward, m.step_base_s, m.step_row_s), m.draft, m.host_node_s,
                          fp, time.perf_counter() - t0, "measured",
                          m.step_base_s, m.step_row_s)
    if path is not None:
        write_cached(path, table.to_json())
    return table

"""The continuous-batching tree engine: many requests, one target forward per step.

Each ``step()``:

0. schedule: every running request gets the KV blocks its next tree may take; where
   the pool runs out, the newest request is preempted (its blocks freed, itself put
   back at the front of the queue to be recomputed); then waiting requests are
   admitted while their prompts' blocks and one tree fit, each reusing the longest
   prefix of cached blocks (``treespark.engine.kv``);
1. prefill chunks: the step's token budget (``max_num_batched_tokens``) goes to the
   running rows' trees first, then to prefill chunks of the admitted requests, oldest
   first (at least a chunk less a token a running row per step, so new arrivals never
   starve, and at most the budget, so running requests keep their pace), the chunks packed into one row with no
   padding (``treespark.engine.prefill``). With requests decoding, the chunks ride in
   step 3's verify forward (``treespark.engine.attend.MixedAttention``: the weights
   stream once for both); with none, they run in a forward of their own. A request's
   last chunk samples its first token at the request's own temperature, and the request
   decodes from the next step on;
2. draft: ONE drafter backbone pass for every running request (with ``cuda_graphs``,
   padded to a bucket and replayed from its CUDA graph, ``treespark.engine.draft_graphs``),
   then every tree grown in depth waves, one batched device call per wave
   (``treespark.spec.drafting``, the rule in ``treespark.spec.select``);
3. verify: ONE target forward over all trees (padded; each row sees its committed
   context and its tree ancestors; with ``cuda_graphs`` and no prefill chunks, padded
   further to a bucket and replayed from that bucket's CUDA graph,
   ``treespark.engine.graphs``) and the step's prefill chunks, then on the
   device the argmax at every node (T = 0), the Gumbel-max draw keyed by position at
   every node (reproducible T > 0 rows, ``treespark.spec.gumbel``) or the recursive
   rejection walk (other T > 0 rows, ``treespark.spec.walk``); one copy brings the
   accepted paths to the host (``treespark.spec.verify`` builds the results);
4. commit: move the accepted nodes' KV entries next to the committed context (inside
   the request's blocks), feed their tapped hidden states to the drafter's context
   cache, key the blocks that became full for the prefix cache, and retire finished
   requests (their blocks are freed at once; nothing is copied); then the prefill
   chunks' tapped states go to the drafter's context and their first tokens out.

Steps 2-4 are ``treespark.engine.decode_step.DecodeStep``, handed the engine's budget,
calibration and allocator (``StepPolicy``) each step.

Preemption is by recomputation and exact: the preempted request keeps its output and
its sampler, recomputes the KV of its prompt and output (mostly from the prefix cache),
and goes on drawing from its own generator where it stopped (no draw happens between
a step's start and its drafting, where preemption happens).

Copies between host and device all go through ``treespark.kernels.transfer`` (and a
test fails on any other). Device to host, each a host sync: one per drafting wave (at
most the drafter's block size), one for verification, one for the logprobs of rows that
ask; a prefill that ends in the step adds one for the first tokens of the requests whose
prompts end there (and one for their logprobs); a request that asked for its tapped
states (``capture_taps``, for drafter training data) keeps them on the device and adds
one copy when it finishes. No copy to the host grows with the vocabulary
(``StepStats.host_syncs`` / ``host_elements``). Host to device, each non-blocking from a
pinned buffer on CUDA (``StepStats.host_uploads``): one for the batch's block tables,
anchors and lengths (the drafter's context gather and the target's forward share it),
one per wave, two for the trees, two for the T > 0 walk, one for reproducible rows,
one for the commit (slot mapping of the moves and of the drafter context), one for
logprobs; the step's prefill one (tokens, positions, block tables, slot mapping), sampled
first tokens one more, logprobs one more. The step never waits for the device
otherwise: ``DecodeStep.measure_stages`` adds two waits (CUDA) so that the stage times
are device times.

The engine is synchronous and not thread-safe: one thread owns it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

from treespark.engine.config import EngineConfig
from treespark.engine.decode_step import DecodeStep, StepPolicy
from treespark.engine.draft_graphs import GraphedDraft, draft_buckets
from treespark.engine.graphs import Buckets, GraphedForward
from treespark.engine.kv import (
    PagedKV,
    StoreShape,
    blocks_for,
    bytes_per_token,
    pool_blocks,
)
from treespark.engine.prefill import Prefill
from treespark.engine.request import Request, check_request, emit
from treespark.engine.scheduler import Scheduler
from treespark.engine.step_alloc import StepAllocator
from treespark.engine.target import TargetRunner
from treespark.kernels.compile import compiled
from treespark.kernels.host_memory import keep_freed_memory
from treespark.kernels.linear import ProductPlan
from treespark.kernels.transfer import HostTransfers
from treespark.models.pair import ModelPair
from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration
from treespark.spec.drafting import WaveDrafter
from treespark.spec.logprobs import TokenLogprob
from treespark.spec.params import RequestOutput, SamplingParams, StepStats
from treespark.spec.sampling import TorchSampler
from treespark.spec.walk import walk_level


class Engine:
    def __init__(
        self,
        pair: ModelPair,
        config: EngineConfig | None = None,
        *,
        budget: Budget | None = None,
        calibration: Calibration | None = None,
        products: ProductPlan | None = None,
    ) -> None:
        """``products``: the target's CPU product layout per row count (default: timed on
        this machine, once per model; ``treespark.engine.products.product_plan``)."""
        self.pair = pair
        self.config = config or EngineConfig()
        self.drafter = pair.drafter
        cfg, dc = self.config, self.drafter.config
        # the most positions past its context a step writes for a request: its largest tree,
        # or the drafter's block, written there in place (``treespark.models.drafter_blocks``)
        room = max(cfg.max_tree_nodes + 1, dc.block_size)
        self.runner = TargetRunner(pair.target, dc.target_layer_ids, products, attention=cfg.attention,
                                   compile_backend=cfg.compile_backend, max_positions=cfg.max_context + room)
        self.device = self.runner.device
        if self.device.type == "cpu":   # the steps' host temporaries reuse what the step before freed
            keep_freed_memory()
        shapes = (self.runner.store_shape, StoreShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim))
        bs = cfg.block_size
        self.block_bytes = bs * bytes_per_token(*shapes, self.runner.dtype)
        # one request at its longest, with its largest tree or block
        per_request = blocks_for(cfg.max_context + room, bs)
        blocks = pool_blocks(per_request, self.block_bytes, max_batch_size=cfg.max_batch_size,
                             kv_blocks=cfg.kv_blocks, budget_bytes=cfg.kv_budget_bytes,
                             memory_fraction=cfg.kv_memory_fraction, device=self.device)
        self.max_batch_size = cfg.max_batch_size
        # + the null block (padding reads and writes it)
        self.kv = PagedKV(*shapes, num_blocks=blocks + 1, block_size=bs, device=self.device,
                          dtype=self.runner.dtype, caching=cfg.prefix_caching)
        # the verify forward and the drafter's block pass: the runner's and the drafter's,
        # or replayed from CUDA graphs by bucket (into one memory pool)
        self.graphs: GraphedForward | None = None
        self.draft_graphs: GraphedDraft | None = None
        if cfg.cuda_graphs:
            if self.device.type != "cuda":
                warnings.warn(f"EngineConfig.cuda_graphs on {self.device}: nothing to capture; the verify forward "
                              "(and with cuda_graphs_draft the drafter's block pass) runs padded to its buckets, "
                              "eagerly (slower than cuda_graphs=False)", stacklevel=2)
            self.graphs = GraphedForward(self.runner, self.kv.target, bs, Buckets.up_to(
                cfg.max_batch_size, cfg.max_tree_nodes + 1, blocks_for(cfg.max_context + cfg.max_tree_nodes + 1, bs)))
        if cfg.cuda_graphs_draft:
            assert self.graphs is not None
            self.draft_graphs = GraphedDraft(self.drafter, self.kv.drafter, bs, draft_buckets(
                cfg.max_batch_size, dc.block_size, cfg.max_context, bs), pool=self.graphs.pool)
        self.budget = budget or Budget.adaptive()
        self.calibration = calibration or pair.calibration
        self.transfers = HostTransfers(self.device)
        markov, d2t = self.drafter.markov_head, self.drafter.draft_to_target
        self.waves = WaveDrafter(markov.markov_w1.weight.detach(), markov.markov_w2.weight.detach(),
                                 d2t, self.transfers, markov.markov_w2.panels)
        self.on_step: Callable[[StepStats], None] | None = None
        self.allocator: StepAllocator | None = None  # per-step allocation (``treespark.engine.step_alloc``)
        self.vocab_size = self.runner.vocab_size

        def tree_slots(req: Request) -> int:
            return self.policy.row_budget(req).node_cap + 1

        self.sched = Scheduler(self.kv, tree_slots, max_batch_size=cfg.max_batch_size,
                               max_num_batched_tokens=cfg.max_num_batched_tokens, prefill_chunk=cfg.prefill_chunk,
                               kv_room=lambda req: max(tree_slots(req), dc.block_size))
        self.prefill = Prefill(self.runner, self.drafter, self.kv, self.sched, self.transfers)
        backend = cfg.compile_backend
        self.decode = DecodeStep(self.runner, self.drafter, self.kv, self.sched, self.prefill, self.waves,
                                 self.transfers, walk_level if backend is None else compiled(walk_level, backend),
                                 d2t, self.graphs, self.draft_graphs)
        self._ids: set[str] = set()
        self._aborted: list[RequestOutput] = []

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    *, budget: Budget | None = None, capture_taps: bool = False) -> None:
        """Queue a request; raises ValueError (saying what is wrong) if it can never run.
        ``capture_taps``: its finished output carries the target's tapped states of every
        position (``RequestOutput.taps``), as the decoding forwards computed them."""
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = check_request(prompt_ids, params, self.config.max_context, self.vocab_size)
        self._ids.add(request_id)
        self.sched.waiting.append(Request(request_id, prompt, params, TorchSampler(params.seed), budget,
                                          taps=[] if capture_taps else None))

    def abort(self, request_id: str) -> None:
        """Drop a request at once (its KV blocks are freed); reported finished with "abort"."""
        if request_id not in self._ids:
            return
        req = self.sched.remove(request_id)
        self._ids.discard(request_id)
        self._aborted.append(RequestOutput(request_id, [], True, "abort", req.stats()))

    def set_budget(self, budget: Budget) -> None:
        self.budget = budget

    def set_allocator(self, allocator: StepAllocator | None) -> None:
        """Price every step's trees (None: verify what the budget drafts)."""
        self.allocator = allocator

    def set_calibration(self, a: float, b: float) -> None:
        """New (a, b) of the T = 0 map (an online refit); the sibling offsets and the
        sampled map stay those of the pair."""
        self.calibration = self.calibration.with_ab(a, b)

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting) + len(self.sched.prefilling)

    @property
    def prefill_computed(self) -> int:
        """Prompt positions computed by prefill forwards (cached prefixes are not)."""
        return self.prefill.computed

    @property
    def kv_rows_in_use(self) -> int:
        """Requests holding KV blocks (running, or admitted and prefilling)."""
        return len(self.sched.running) + len(self.sched.prefilling)

    @property
    def kv_usage(self) -> float:
        """The fraction of the pool's blocks held by requests (cached free blocks excluded)."""
        return self.kv.pool.blocks_in_use / self.kv.pool.num_usable

    # the scheduler's counters, under vLLM's names: requests preempted (by recomputation),
    # prompt tokens looked up in the prefix cache, and of those the tokens found cached
    @property
    def preemptions(self) -> int:
        return self.sched.preemptions

    @property
    def prefix_cache_queries(self) -> int:
        return self.sched.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.sched.prefix_cache_hits

    @property
    def on_schedule(self) -> Callable[[str], None] | None:
        """Called with a request id leaving the waiting queue (None: no hook)."""
        return self.sched.on_schedule

    @on_schedule.setter
    def on_schedule(self, hook: Callable[[str], None] | None) -> None:
        self.sched.on_schedule = hook

    def has_unfinished(self) -> bool:
        return self.sched.has_requests or bool(self._aborted)

    # -- the step ------------------------------------------------------------------------
    @property
    def policy(self) -> StepPolicy:
        """What decides this step's trees (the settings above), handed to the step."""
        return StepPolicy(self.budget, self.calibration, self.allocator, self.config.max_tree_nodes)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.transfers.new_step()
        outputs, self._aborted = self._aborted, []
        self.sched.reserve_trees()
        chunks = self.sched.schedule_prefill()

        firsts: list[RequestOutput] = []   # the first tokens of requests whose prompts end in this step

        def first(req: Request, token: int, lps: list[TokenLogprob] | None) -> bool:
            firsts.append(emit(req, [token], self.transfers, first=True, logprobs=lps))
            return firsts[-1].finished

        if self.sched.running:   # the chunks ride in the verify forward
            done, stats = self.decode.run(t0, self.policy, self.prefill.prepare(chunks) if chunks else None, first,
                                          stats=self.on_step is not None)
            outputs += done
            if stats is not None and self.on_step is not None:
                self.on_step(stats)
        else:
            self.prefill.step(chunks, first)
        outputs += firsts
        for out in outputs:
            if out.finished:
                self._ids.discard(out.request_id)
        return outputs

    @property
    def graph_captures(self) -> int | None:
        """CUDA graphs captured so far, the verify forward's and the block pass's (None:
        ``cuda_graphs`` off)."""
        if self.graphs is None:
            return None
        return self.graphs.captures + (0 if self.draft_graphs is None else self.draft_graphs.captures)

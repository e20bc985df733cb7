"""The continuous-batching tree engine: many requests, one target forward per step.

Each ``step()``:

0. schedule: every running request gets the KV blocks its next tree may take; where
   the pool runs out, the newest request is preempted (its blocks freed, itself put
   back at the front of the queue to be recomputed); then waiting requests are
   admitted while their prompts' blocks and one tree fit, each reusing the longest
   prefix of cached blocks (``treespark.engine.kv``);
1. prefill chunks: the step's token budget (``max_num_batched_tokens``) goes to the
   running rows' trees first, then to prefill chunks of the admitted requests, oldest
   first (at least one chunk per step, so new arrivals never starve, and at most the
   budget, so running requests keep their pace), the chunks packed into one row with no
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
otherwise: ``measure_stages`` adds two waits (CUDA) so that the stage times are device
times.

The engine is synchronous and not thread-safe: one thread owns it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

from treespark.engine.accept import accept
from treespark.engine.attend import PagedContext
from treespark.engine.commit import apply_commit, commit_plan
from treespark.engine.config import EngineConfig
from treespark.engine.draft_graphs import GraphedDraft, draft_buckets
from treespark.engine.graphs import Buckets, GraphedForward
from treespark.engine.kv import (
    PagedKV,
    StoreShape,
    blocks_for,
    bytes_per_token,
    pool_blocks,
)
from treespark.engine.prefill import (
    Emit,
    Prefill,
    PrefillInputs,
    RiddenForward,
    forward_with_trees,
)
from treespark.engine.request import Request, check_request, clip_emitted
from treespark.engine.scheduler import Scheduler
from treespark.engine.step_alloc import StepAllocator
from treespark.engine.step_stats import step_stats
from treespark.engine.target import TargetRunner
from treespark.kernels.compile import compiled
from treespark.kernels.linear import ProductPlan
from treespark.kernels.transfer import HostTransfers
from treespark.models.pair import ModelPair
from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration
from treespark.spec.drafting import RoundDraft, RowDraft, WaveDrafter
from treespark.spec.gumbel import PositionKey
from treespark.spec.logprobs import Emitted, TokenLogprob, step_logprobs
from treespark.spec.params import RequestOutput, RoundStats, SamplingParams, StepStats
from treespark.spec.sampling import TorchSampler
from treespark.spec.tree import DraftTree, tree_batch
from treespark.spec.verify import VerifyResult
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
        backend = self.config.compile_backend
        self._walk_level = walk_level if backend is None else compiled(walk_level, backend)  # a depth of the T > 0 walk
        self.device = self.runner.device
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
        # wait for the device before reading each stage's clock (CUDA), so that draft_s and
        # verify_s are device times: two more host syncs a step, so only when measuring
        self.measure_stages = False
        markov = self.drafter.markov_head
        self._d2t = self.drafter.draft_to_target
        self.waves = WaveDrafter(markov.markov_w1.weight.detach(), markov.markov_w2.weight.detach(),
                                 self._d2t, self.transfers, markov.markov_w2.panels)
        self.on_step: Callable[[StepStats], None] | None = None
        self.allocator: StepAllocator | None = None  # per-step allocation (``treespark.engine.step_alloc``)
        self.vocab_size = self.runner.vocab_size
        def tree_slots(req: Request) -> int:
            return self._row_budget(req).node_cap + 1

        self.sched = Scheduler(self.kv, tree_slots, max_batch_size=cfg.max_batch_size,
                               max_num_batched_tokens=cfg.max_num_batched_tokens, prefill_chunk=cfg.prefill_chunk,
                               kv_room=lambda req: max(tree_slots(req), dc.block_size))
        self.prefill = Prefill(self.runner, self.drafter, self.kv, self.sched, self.transfers)
        # the verify step's logits, written into the same memory step after step (CPU; the
        # largest step's, [rows x nodes x V] float32, kept: 78 MB at 8 x 16 x 151,936)
        self._logits = torch.empty(0)
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
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.transfers.new_step()
        outputs, self._aborted = self._aborted, []
        self.sched.reserve_trees()
        chunks = self.sched.schedule_prefill()

        def first(req: Request, token: int, lps: list[TokenLogprob] | None) -> bool:
            return self._emit(req, [token], outputs, is_prefill=True, logprobs=lps)

        if self.sched.running:   # the chunks ride in the verify forward
            outputs += self._decode_step(t0, self.prefill.prepare(chunks) if chunks else None, first)
        else:
            self.prefill.step(chunks, first)
        return outputs

    def _row_budget(self, req: Request) -> Budget:
        b = req.budget or self.budget
        cap = min(b.node_cap, self.config.max_tree_nodes)
        return b if cap == b.node_cap else Budget(b.theta, cap, b.branch_cap)

    def _decode_step(self, t0: float, pre: PrefillInputs | None, first: Emit) -> list[RequestOutput]:
        """Draft, verify (``pre``'s chunks in the same forward), accept and commit the
        running requests' trees; then the chunks' requests (``Prefill.finish``, ``first``
        emitting a first token)."""
        batch = list(self.sched.running)
        lengths = [r.computed for r in batch]
        t_draft = time.perf_counter()
        budgets = [self._row_budget(r) for r in batch]
        if self.allocator is not None:
            budgets = self.allocator.drafting([r.id for r in batch], budgets, [r.budget is None for r in batch],
                                              self.budget.theta)
        # one upload: the batch's block tables (every block its tree may take is reserved
        # already), the anchors and the lengths; the drafter's context gather and the
        # target's forward both address the blocks through it
        nb = max(len(r.blocks) for r in batch)
        table = self.kv.table([r.blocks for r in batch], nb)
        ints = self.transfers.upload(np.concatenate([table, np.asarray([[r.root for r in batch], lengths]).T], 1),
                                     torch.long)                                      # [B, nb + 2]
        table_d, anchors, lengths_d = ints[:, :nb], ints[:, nb], ints[:, nb + 1]
        drafted = self._draft(batch, budgets, lengths, table_d, anchors, lengths_d)
        if self.measure_stages:
            self.sync()
        policy_s = 0.0 if self.allocator is None else self.allocator.policy_s
        if self.allocator is not None and drafted.waves:
            drafted = self.allocator.cut([r.id for r in batch], [r.params.temperature for r in batch],
                                         [r.budget is None for r in batch], drafted, self.budget.theta)
            policy_s = self.allocator.policy_s
        t_verify = time.perf_counter()
        logits, taps, ridden = self._verify_forward(batch, drafted.trees, lengths, table_d, pre)
        results = accept(batch, drafted, logits, self.transfers, self._d2t, self._walk_level)
        asked = [Emitted(i, [0, *r.path], list(r.tokens), req.params.logprobs)
                 for i, (req, r) in enumerate(zip(batch, results, strict=True)) if req.params.logprobs is not None]
        lps = dict(zip((e.row for e in asked), step_logprobs(logits, asked, self.transfers), strict=True))
        outputs = self._commit(batch, drafted.trees, results, taps, lengths, lps)
        prefill_tokens = 0 if ridden is None else self.prefill.finish(pre, ridden.chunk_taps, ridden.first_logits,
                                                                      first)
        if self.measure_stages:
            self.sync()
        t_end = time.perf_counter()
        observe = self.allocator is not None and self.allocator.observes
        if self.on_step is not None or observe:
            stats = step_stats(batch, drafted, results, budgets, theta=self.budget.theta,
                               times=(t0, t_draft, t_verify, t_end), prefill_tokens=prefill_tokens,
                               host=self.transfers.counts(), policy_s=policy_s)
            if observe:
                self.allocator.observe(stats)
            if self.on_step is not None:
                self.on_step(stats)
        return outputs

    @property
    def graph_captures(self) -> int | None:
        """CUDA graphs captured so far, the verify forward's and the block pass's (None:
        ``cuda_graphs`` off)."""
        if self.graphs is None:
            return None
        return self.graphs.captures + (0 if self.draft_graphs is None else self.draft_graphs.captures)

    def sync(self) -> None:
        """Wait for the device (CUDA): stage times then measure device work, not the
        launches. One host sync; a no-op on CPU."""
        if self.device.type == "cuda":
            self.transfers.syncs += 1
            torch.cuda.synchronize(self.device)

    def _draft(self, batch: list[Request], budgets: list[Budget], lengths: list[int], table: torch.Tensor,
               anchors: torch.Tensor, lengths_d: torch.Tensor) -> RoundDraft:
        """One drafter backbone pass for the batch (its context gathered from the blocks of
        ``table``), then the trees in depth waves."""
        block = self.drafter.config.block_size
        # a row drafts no deeper than its node cap (a node at depth d has d - 1 ancestors) nor its block
        limits = [min(block, r.params.max_tokens - len(r.output) - 1, b.node_cap)
                  for r, b in zip(batch, budgets, strict=True)]
        deepest = max((d for b, d in zip(budgets, limits, strict=True) if not b.is_off), default=0)
        if deepest <= 0:   # a plain step: no backbone pass, no forest
            return RoundDraft.roots([r.root for r in batch])
        rows = [RowDraft(root=r.root, budget=b, depth_limit=d,
                         temperature=self.calibration.draft_temperature(r.params.temperature),
                         calibration=self.calibration.at(r.params.temperature), sampler=r.sampler,
                         key=PositionKey.of(r.params.seed, r.next_index) if r.params.keyed else None)
                for r, b, d in zip(batch, budgets, limits, strict=True)]
        context = PagedContext(self.kv.drafter, table, self.kv.block_size, max(lengths))
        drafter = self.drafter if self.draft_graphs is None else self.draft_graphs
        return self.waves.draft(drafter.block_logits(anchors, context, lengths_d, deepest), rows)

    def _verify_forward(self, batch: list[Request], trees: list[DraftTree], lengths: list[int],
                        table: torch.Tensor, pre: PrefillInputs | None
                        ) -> tuple[torch.Tensor, torch.Tensor, RiddenForward | None]:
        """One target forward over every tree, and ``pre``'s prefill chunks with them
        (``forward_with_trees``): the trees' logits [B, K, V] and taps [B, K, taps] on the
        device, and what the chunks got (None: no chunks)."""
        b = tree_batch(trees, lengths, self.device, self.transfers.upload)
        rows = self.kv.rows(table, b.mask.shape[-1])
        need = (b.tokens.numel() + (0 if pre is None else len(pre.batch.firsts))) * self.vocab_size
        if self.device.type == "cpu" and self._logits.numel() < need:
            self._logits = torch.empty(need, dtype=torch.float32)
        if pre is not None:
            ridden = forward_with_trees(self.runner, self.kv.target, rows, b, pre, self._logits)
            return ridden.logits, ridden.taps, ridden
        if self.graphs is not None:
            out = self.graphs.forward(b.tokens, b.positions, b.write_pos, rows, b.mask, logits_into=self._logits)
        else:
            out = self.runner.forward(b.tokens, b.positions, b.write_pos, self.kv.target, rows, b.mask,
                                      logits_into=self._logits)
        assert out.logits is not None
        return out.logits, out.taps, None

    def _commit(self, batch: list[Request], trees: list[DraftTree], results: list[VerifyResult],
                taps: torch.Tensor, lengths: list[int],
                logprobs: dict[int, list[TokenLogprob]]) -> list[RequestOutput]:
        """Emit the rounds' tokens, keep the accepted nodes' KV entries next to the
        committed context, feed their taps to the drafter, retire finished requests."""
        # every row's root and accepted nodes move next to its committed context (inside
        # its own tail blocks, never a shared or keyed one: those hold positions below its
        # length only), and their taps go to the drafter. Rows that finish now too: their
        # blocks are freed below, whatever they hold.
        plan = commit_plan([list(r.path) for r in results], lengths,
                           lambda i, positions: self.kv.slots(batch[i].blocks, positions))
        keeps, m = plan.keeps, len(plan.rows)
        kept_taps = apply_commit(plan, self.kv, self.drafter, taps, self.transfers)
        outputs: list[RequestOutput] = []
        commit_reqs = []
        at = 0
        for i, (req, tree, result) in enumerate(zip(batch, trees, results, strict=True)):
            req.rounds.append(RoundStats(tree.size, tree.depth, tree.width, result.accepted,
                                         (req.budget or self.budget).theta))
            n = len(keeps[i])
            if req.taps is not None:                # (a finished row's are cut to its output)
                req.taps.append(kept_taps[at:at + n])
            at += n
            if self._emit(req, list(result.tokens), outputs, logprobs=logprobs.get(i)):
                continue
            commit_reqs.append(req)
            req.computed = lengths[i] + n
            req.root = result.tokens[-1]
        assert at == m
        for req in commit_reqs:
            self.sched.cache_blocks(req)
        for req in [r for r in batch if r.id not in self._ids]:
            self.sched.release(req)
        return outputs

    def _emit(self, req: Request, tokens: list[int], outputs: list[RequestOutput],
              is_prefill: bool = False, logprobs: list[TokenLogprob] | None = None) -> bool:
        """Append emitted tokens, applying stop tokens and max_tokens; True if finished."""
        tokens, reason = clip_emitted(tokens, req.params, len(req.output))
        req.output += tokens
        if is_prefill and reason is None:
            req.root = tokens[-1]
        finished = reason is not None
        if finished:
            self._ids.discard(req.id)
        lps = None if logprobs is None else tuple(logprobs[:len(tokens)])
        taps = None
        if finished and req.taps is not None:
            positions = len(req.prompt) + len(req.output) - 1
            taps = self.transfers.fetch(torch.cat(req.taps)[:positions].to(torch.float16))
        outputs.append(RequestOutput(req.id, tokens, finished, reason, req.stats() if finished else None, lps, taps))
        return finished

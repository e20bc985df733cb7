"""One decode step over the running requests: draft, verify, accept, commit.

``DecodeStep`` holds the parts a step uses (the target's runner, the paged KV, the
scheduler, the wave drafter, the transfers; built once by ``treespark.engine.core``) and
takes what decides its trees, ``StepPolicy`` (the engine's budget, calibration and
per-step allocator, which the engine's owner may change between steps), as an argument
of every ``run``. The stages, in order:

* budgets: each row's own budget or the policy's, capped at the engine's largest tree;
  with an allocator, capped again to what this step's price pays for;
* draft: one upload of the batch's block tables, anchors and lengths; one drafter block
  pass over every drafting row (its context read from the blocks in place); the trees in
  depth waves (``treespark.spec.drafting``); with an allocator, each tree cut to its share;
* verify: one target forward over every tree (and the step's prefill chunks, when
  ``pre`` carries some); the accepted paths come to the host in one copy
  (``treespark.engine.accept``), the logprobs of rows that ask in one more;
* commit: the accepted nodes' KV next to the committed context, their taps to the
  drafter's context, full blocks keyed for the prefix cache, tokens emitted, finished
  requests' blocks freed; then the chunks' requests (``Prefill.finish``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from treespark.engine.accept import accept
from treespark.engine.attend import PagedContext
from treespark.engine.commit import apply_commit, commit_plan
from treespark.engine.draft_graphs import GraphedDraft
from treespark.engine.graphs import GraphedForward
from treespark.engine.kv import PagedKV
from treespark.engine.prefill import Emit, Prefill, PrefillInputs, RiddenForward, forward_with_trees
from treespark.engine.request import Request, emit
from treespark.engine.scheduler import Scheduler
from treespark.engine.step_alloc import StepAllocator
from treespark.engine.step_stats import step_stats
from treespark.engine.target import TargetRunner
from treespark.kernels.transfer import HostTransfers
from treespark.models.drafter import DSparkDrafter
from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration
from treespark.spec.drafting import RoundDraft, RowDraft, WaveDrafter
from treespark.spec.gumbel import PositionKey
from treespark.spec.logprobs import Emitted, TokenLogprob, step_logprobs
from treespark.spec.params import RequestOutput, RoundStats, StepStats
from treespark.spec.tree import DraftTree, tree_batch
from treespark.spec.verify import VerifyResult


@dataclass(frozen=True)
class StepPolicy:
    """What decides a step's trees: ``budget``, the engine's (rows without a budget of
    their own follow it, its theta the price of speculation); ``calibration``, the maps
    from draft scores to acceptance; ``allocator``, the per-step allocation (None: verify
    what the budgets draft); ``max_tree_nodes``, the engine's largest tree."""
    budget: Budget
    calibration: Calibration
    allocator: StepAllocator | None
    max_tree_nodes: int

    def row_budget(self, req: Request) -> Budget:
        """``req``'s budget (its own, or the engine's) with its node cap at most the engine's largest tree."""
        b = req.budget or self.budget
        cap = min(b.node_cap, self.max_tree_nodes)
        return b if cap == b.node_cap else Budget(b.theta, cap, b.branch_cap)


@dataclass(eq=False)
class DecodeStep:
    """The running requests' decode step (module docstring). ``draft_graphs`` / ``graphs``:
    the drafter's block pass and the verify forward replayed from CUDA graphs by bucket
    (None: eager). ``measure_stages``: wait for the device before reading each stage's
    clock (CUDA), so that ``draft_s`` and ``verify_s`` are device times: two more host
    syncs a step, so only when measuring."""
    runner: TargetRunner
    drafter: DSparkDrafter
    kv: PagedKV
    sched: Scheduler
    prefill: Prefill
    waves: WaveDrafter
    transfers: HostTransfers
    walk_level: Callable          # a depth of the T > 0 walk (``treespark.spec.walk``), maybe compiled
    draft_to_target: torch.Tensor | None   # the drafter's (made once: the property makes a vocabulary's arange)
    graphs: GraphedForward | None = None
    draft_graphs: GraphedDraft | None = None
    measure_stages: bool = False
    # the verify step's logits, written into the same memory step after step (CPU; the
    # largest step's, [rows x nodes x V] float32, kept: 78 MB at 8 x 16 x 151,936)
    _logits: torch.Tensor = field(default_factory=lambda: torch.empty(0), init=False, repr=False)

    def sync(self) -> None:
        """Wait for the device (CUDA): stage times then measure device work, not the
        launches. One host sync; a no-op on CPU."""
        if self.runner.device.type == "cuda":
            self.transfers.syncs += 1
            torch.cuda.synchronize(self.runner.device)

    def run(self, t0: float, policy: StepPolicy, pre: PrefillInputs | None, first: Emit, *,
            stats: bool) -> tuple[list[RequestOutput], StepStats | None]:
        """Draft, verify (``pre``'s chunks in the same forward), accept and commit the
        running requests' trees; then the chunks' requests (``Prefill.finish``, ``first``
        emitting a first token). The step's outputs, and its stats where ``stats`` is True
        or the allocator observes them (``t0``: the step's start)."""
        batch = list(self.sched.running)
        lengths = [r.computed for r in batch]
        allocator = policy.allocator
        theta = policy.budget.theta
        t_draft = time.perf_counter()
        budgets = [policy.row_budget(r) for r in batch]
        if allocator is not None:   # (rows with a budget of their own do not follow the allocation)
            ids, follows = [r.id for r in batch], [r.budget is None for r in batch]
            budgets = allocator.drafting(ids, budgets, follows, theta)
        # one upload: the batch's block tables (every block its tree may take is reserved
        # already), the anchors and the lengths; the drafter's context gather and the
        # target's forward both address the blocks through it
        nb = max(len(r.blocks) for r in batch)
        table = self.kv.table([r.blocks for r in batch], nb)
        ints = self.transfers.upload(np.concatenate([table, np.asarray([[r.root for r in batch], lengths]).T], 1),
                                     torch.long)                                      # [B, nb + 2]
        table_d, anchors, lengths_d = ints[:, :nb], ints[:, nb], ints[:, nb + 1]
        drafted = self._draft(batch, budgets, policy.calibration, lengths, table_d, anchors, lengths_d)
        if self.measure_stages:
            self.sync()
        policy_s = 0.0 if allocator is None else allocator.policy_s
        if allocator is not None and drafted.waves:
            drafted = allocator.cut(ids, [r.params.temperature for r in batch], follows, drafted, theta)
            policy_s = allocator.policy_s
        t_verify = time.perf_counter()
        logits, taps, ridden = self._verify_forward(drafted.trees, lengths, table_d, pre)
        results = accept(batch, drafted, logits, self.transfers, self.draft_to_target, self.walk_level)
        asked = [Emitted(i, [0, *r.path], list(r.tokens), req.params.logprobs)
                 for i, (req, r) in enumerate(zip(batch, results, strict=True)) if req.params.logprobs is not None]
        lps = dict(zip((e.row for e in asked), step_logprobs(logits, asked, self.transfers), strict=True))
        outputs = self._commit(batch, drafted.trees, results, taps, lengths, lps, policy.budget)
        prefill_tokens = 0 if ridden is None else self.prefill.finish(pre, ridden.chunk_taps, ridden.first_logits,
                                                                      first)
        if self.measure_stages:
            self.sync()
        t_end = time.perf_counter()
        observe = allocator is not None and allocator.observes
        if not (stats or observe):
            return outputs, None
        made = step_stats(batch, drafted, results, budgets, theta=theta, times=(t0, t_draft, t_verify, t_end),
                          prefill_tokens=prefill_tokens, host=self.transfers.counts(), policy_s=policy_s)
        if observe:
            allocator.observe(made)
        return outputs, made

    def _draft(self, batch: list[Request], budgets: list[Budget], calibration: Calibration, lengths: list[int],
               table: torch.Tensor, anchors: torch.Tensor, lengths_d: torch.Tensor) -> RoundDraft:
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
                         temperature=calibration.draft_temperature(r.params.temperature),
                         calibration=calibration.at(r.params.temperature), sampler=r.sampler,
                         key=PositionKey.of(r.params.seed, r.next_index) if r.params.keyed else None)
                for r, b, d in zip(batch, budgets, limits, strict=True)]
        context = PagedContext(self.kv.drafter, table, self.kv.block_size, max(lengths))
        drafter = self.drafter if self.draft_graphs is None else self.draft_graphs
        return self.waves.draft(drafter.block_logits(anchors, context, lengths_d, deepest), rows)

    def _verify_forward(self, trees: list[DraftTree], lengths: list[int], table: torch.Tensor,
                        pre: PrefillInputs | None) -> tuple[torch.Tensor, torch.Tensor, RiddenForward | None]:
        """One target forward over every tree, and ``pre``'s prefill chunks with them
        (``forward_with_trees``): the trees' logits [B, K, V] and taps [B, K, taps] on the
        device, and what the chunks got (None: no chunks)."""
        device = self.runner.device
        b = tree_batch(trees, lengths, device, self.transfers.upload)
        rows = self.kv.rows(table, b.mask.shape[-1])
        need = (b.tokens.numel() + (0 if pre is None else len(pre.batch.firsts))) * self.runner.vocab_size
        if device.type == "cpu" and self._logits.numel() < need:
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
                taps: torch.Tensor, lengths: list[int], logprobs: dict[int, list[TokenLogprob]],
                budget: Budget) -> list[RequestOutput]:
        """Emit the rounds' tokens, keep the accepted nodes' KV entries next to the
        committed context, feed their taps to the drafter, retire finished requests.
        ``budget``: the engine's (the theta a round of a row without its own ran at)."""
        # every row's root and accepted nodes move next to its committed context (inside
        # its own tail blocks, never a shared or keyed one: those hold positions below its
        # length only), and their taps go to the drafter. Rows that finish now too: their
        # blocks are freed below, whatever they hold.
        plan = commit_plan([list(r.path) for r in results], lengths,
                           lambda i, positions: self.kv.slots(batch[i].blocks, positions))
        keeps, m = plan.keeps, len(plan.rows)
        kept_taps = apply_commit(plan, self.kv, self.drafter, taps, self.transfers)
        outputs: list[RequestOutput] = []
        going, finished = [], []
        at = 0
        for i, (req, tree, result) in enumerate(zip(batch, trees, results, strict=True)):
            req.rounds.append(RoundStats(tree.size, tree.depth, tree.width, result.accepted,
                                         (req.budget or budget).theta))
            n = len(keeps[i])
            if req.taps is not None:                # (a finished row's are cut to its output)
                req.taps.append(kept_taps[at:at + n])
            at += n
            out = emit(req, list(result.tokens), self.transfers, logprobs=logprobs.get(i))
            outputs.append(out)
            if out.finished:
                finished.append(req)
                continue
            going.append(req)
            req.computed = lengths[i] + n
            req.root = result.tokens[-1]
        assert at == m
        for req in going:
            self.sched.cache_blocks(req)
        for req in finished:
            self.sched.release(req)
        return outputs

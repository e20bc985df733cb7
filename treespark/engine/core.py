"""The continuous-batching tree engine: many requests, one target forward per step.

Each ``step()``:

1. prefill: at most one chunk of one waiting request's prompt (in the KV cache's
   staging row), so new arrivals never starve running requests; its last chunk
   samples the first token at the request's own temperature;
2. draft: ONE drafter backbone pass for every running request, then every tree grown
   in depth waves, one batched device call per wave (``treespark.spec.drafting``, the rule
   in ``treespark.spec.select``);
3. verify: ONE target forward over all trees (padded; each row sees its committed
   context and its tree ancestors), then on the device the argmax at every node
   (T = 0) or the recursive rejection walk (T > 0, ``treespark.spec.walk``); one copy
   brings the accepted paths to the host (``treespark.spec.verify`` builds the results);
4. commit: move the accepted nodes' KV entries next to the committed context, feed
   their tapped hidden states to the drafter's context cache, and retire finished
   requests (their rows are freed at once; the last running row moves into the gap
   so the batch stays a contiguous view).

Copies between host and device all go through ``treespark.kernels.transfer`` (and a
test fails on any other). Device to host, each a host sync: one per drafting wave (at
most the drafter's block size), one for verification, one for the logprobs of rows that
ask; a prefill that ends in the step adds one for its first token (and one for its
logprobs); a request that asked for its tapped states (``capture_taps``, for drafter
training data) keeps them on the device and adds one copy when it finishes. No copy to
the host grows with the vocabulary (``StepStats.host_syncs`` / ``host_elements``). Host
to device, each non-blocking from a pinned buffer on CUDA (``StepStats.host_uploads``):
one for the backbone, one per wave, two for the trees, two for the T > 0 walk, one for
the commit, one for logprobs; a prefill chunk one, a sampled first token one more. The
step never waits for the device otherwise: ``measure_stages`` adds two waits (CUDA) so
that the stage times are device times.

The engine is synchronous and not thread-safe: one thread owns it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treespark.engine.kv import KVCache, StoreShape, bytes_per_token, device_kv_budget, rows_within
from treespark.engine.request import Request, check_request, clip_emitted
from treespark.engine.step_alloc import StepAllocator
from treespark.engine.step_stats import step_stats
from treespark.engine.target import TargetRunner
from treespark.kernels.linear import ProductPlan
from treespark.kernels.transfer import HostTransfers
from treespark.models.pair import ModelPair
from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration
from treespark.spec.drafting import RoundDraft, RowDraft, WaveDrafter
from treespark.spec.logprobs import Emitted, TokenLogprob, step_logprobs
from treespark.spec.params import RequestOutput, RoundStats, SamplingParams, StepStats
from treespark.spec.sampling import TorchSampler, sample_rows, target_probs_rows
from treespark.spec.tree import DraftTree, tree_batch
from treespark.spec.verify import VerifyResult, verify_greedy, walked
from treespark.spec.walk import SampledTrees, branching, walk_sampled


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8         # running requests verified together
    max_context: int = 1024         # prompt + generated tokens per request
    max_tree_nodes: int = 64        # hard cap on draft nodes per tree, whatever the budget
    prefill_chunk: int = 256        # prompt tokens per prefill forward
    # KV memory: rows (a full context each, target + drafter) beyond what the budget holds
    # are not allocated, and the engine runs fewer requests than max_batch_size at once
    kv_budget_bytes: int = 0        # 0: no budget in bytes
    kv_memory_fraction: float = 0.0 # 0: none; else this fraction of device memory less what is in use

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_context", "prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0")
        if self.kv_budget_bytes < 0 or not 0.0 <= self.kv_memory_fraction <= 1.0:
            raise ValueError("EngineConfig.kv_budget_bytes must be >= 0 and kv_memory_fraction in [0, 1]")
        if self.max_tree_nodes < 0:
            raise ValueError("EngineConfig.max_tree_nodes must be >= 0")


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
        this machine, once per model; ``treespark.engine.target.product_plan``)."""
        self.pair = pair
        self.config = config or EngineConfig()
        self.drafter = pair.drafter
        self.runner = TargetRunner(pair.target, self.drafter.config.target_layer_ids, products)
        self.device = self.runner.device
        dc = self.drafter.config
        shapes = (self.runner.store_shape, StoreShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim))
        capacity = self.config.max_context + self.config.max_tree_nodes + 1
        self.row_bytes = capacity * bytes_per_token(*shapes, self.runner.dtype)
        limits = [self.config.kv_budget_bytes] if self.config.kv_budget_bytes else []
        if self.config.kv_memory_fraction:
            limits.append(device_kv_budget(self.device, self.config.kv_memory_fraction))
        # the running requests at once: what the KV budget holds, at most max_batch_size
        self.max_batch_size = (rows_within(min(limits), self.row_bytes, self.config.max_batch_size) if limits
                               else self.config.max_batch_size)
        self.kv = KVCache(*shapes, max_batch=self.max_batch_size, capacity=capacity,
                          device=self.device, dtype=self.runner.dtype)
        self.budget = budget or Budget.adaptive()
        self.calibration = calibration or pair.calibration
        self.transfers = HostTransfers(self.device)
        # wait for the device before reading each stage's clock (CUDA), so that draft_s and
        # verify_s are device times: two more host syncs a step, so only when measuring
        self.measure_stages = False
        markov = self.drafter.markov_head
        self._d2t = self.drafter.draft_to_target
        self.waves = WaveDrafter(markov.markov_w1.weight.detach(), markov.markov_w2.weight.detach(),
                                 self._d2t, self.transfers)
        self.on_step: Callable[[StepStats], None] | None = None
        self.on_schedule: Callable[[str], None] | None = None  # a request id leaving the waiting queue
        self.allocator: StepAllocator | None = None  # per-step allocation (``treespark.engine.step_alloc``)
        self.vocab_size = self.runner.vocab_size
        self._waiting: deque[Request] = deque()
        self._staging: Request | None = None
        self._running: list[Request] = []
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
        self._waiting.append(Request(request_id, prompt, params, TorchSampler(params.seed), budget,
                                     taps=[] if capture_taps else None))

    def abort(self, request_id: str) -> None:
        """Drop a request at once (its KV row is freed); reported finished with "abort"."""
        if request_id not in self._ids:
            return
        req = next((r for r in self._waiting if r.id == request_id), None)
        if req is not None:
            self._waiting.remove(req)
        elif self._staging is not None and self._staging.id == request_id:
            req, self._staging = self._staging, None
            self.kv.free(self.kv.staging)
        else:
            req = next(r for r in self._running if r.id == request_id)
            self._release(req)
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
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + (self._staging is not None)

    @property
    def kv_rows_in_use(self) -> int:
        """KV rows holding a request."""
        return self.kv.slots_in_use

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._staging or self._aborted)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.transfers.new_step()
        outputs, self._aborted = self._aborted, []
        prefill_tokens = self._prefill_step(outputs)
        if self._running:
            outputs += self._decode_step(t0, prefill_tokens)
        return outputs

    def _prefill_step(self, outputs: list[RequestOutput]) -> int:
        if self._staging is None:
            if not self._waiting or len(self._running) >= self.max_batch_size:
                return 0
            self._staging = self._waiting.popleft()
            self._staging.slot = self.kv.staging
            if self.on_schedule is not None:
                self.on_schedule(self._staging.id)
        req = self._staging
        start = req.prefilled
        end = min(len(req.prompt), start + self.config.prefill_chunk)
        last = end == len(req.prompt)
        dev = self.device
        tokens = self.transfers.upload([req.prompt[start:end]], torch.long)
        pos = torch.arange(start, end, device=dev)[None]
        mask = (torch.arange(end, device=dev)[None, :] <= pos[0][:, None])[None, None]
        rows = slice(req.slot, req.slot + 1)
        out = self.runner.forward(tokens, pos, pos, self.kv.target, rows, mask,
                                  logits_for="last" if last else "none")
        self._write_context(req.slot, out.taps[0], pos[0])
        if req.taps is not None:
            req.taps.append(out.taps[0])
        req.prefilled = end
        self.kv.lengths[req.slot] = end
        if last:
            self._staging = None
            assert out.logits is not None
            first = self._sample_first(req, out.logits[:, -1])
            lps = None
            if req.params.logprobs is not None:
                (lps,) = step_logprobs(out.logits[:, -1:], [Emitted(0, [0], [first], req.params.logprobs)],
                                       self.transfers)
            done = self._emit(req, [first], outputs, is_prefill=True, logprobs=lps)
            if done:
                self.kv.free(req.slot)
            else:
                row = len(self._running)
                self.kv.copy_row(req.slot, row)
                req.slot = row
                self._running.append(req)
        return end - start

    def _sample_first(self, req: Request, logits: torch.Tensor) -> int:
        """The first token after prefill (logits [1, V]), at the request's temperature
        (never argmax at T > 0)."""
        t = req.params.temperature
        if t == 0:
            token = logits.argmax(-1)
        else:
            # one upload: the temperature, the uniform and top-p
            # (top-p rounded to float32, the precision it has always been applied at)
            x = self.transfers.upload([t, *req.sampler.uniform(1), float(np.float32(req.params.top_p))],
                                      torch.float64)
            p = target_probs_rows(logits, x[:1], None if req.params.top_p >= 1 else x[2:])
            token = sample_rows(p, x[1:2])
        return int(self.transfers.fetch(token)[0])

    def _write_context(self, slot: int, taps: torch.Tensor, pos: torch.Tensor) -> None:
        """Feed committed positions' tapped hidden states to the drafter's context cache."""
        k, v = self.drafter.context_kv(taps[None].to(self.drafter.fc.weight.dtype), pos[None])
        self.kv.drafter.write_all(slice(slot, slot + 1), pos[None], k, v)

    def _row_budget(self, req: Request) -> Budget:
        b = req.budget or self.budget
        cap = min(b.node_cap, self.config.max_tree_nodes)
        return b if cap == b.node_cap else Budget(b.theta, cap, b.branch_cap)

    def _decode_step(self, t0: float, prefill_tokens: int) -> list[RequestOutput]:
        batch = list(self._running)
        assert all(r.slot == i for i, r in enumerate(batch)), "running rows must be compact"
        lengths = [self.kv.lengths[r.slot] for r in batch]
        t_draft = time.perf_counter()
        budgets = [self._row_budget(r) for r in batch]
        if self.allocator is not None:
            budgets = self.allocator.drafting([r.id for r in batch], budgets, [r.budget is None for r in batch],
                                              self.budget.theta)
        drafted = self._draft(batch, budgets, lengths)
        if self.measure_stages:
            self.sync()
        policy_s = 0.0 if self.allocator is None else self.allocator.policy_s
        if self.allocator is not None and drafted.waves:
            drafted = self.allocator.cut([r.id for r in batch], [r.params.temperature for r in batch],
                                         [r.budget is None for r in batch], drafted, self.budget.theta)
            policy_s = self.allocator.policy_s
        t_verify = time.perf_counter()
        logits, taps = self._verify_forward(batch, drafted.trees, lengths)
        results = self._accept(batch, drafted, logits)
        asked = [Emitted(i, [0, *r.path], list(r.tokens), req.params.logprobs)
                 for i, (req, r) in enumerate(zip(batch, results, strict=True)) if req.params.logprobs is not None]
        lps = dict(zip((e.row for e in asked), step_logprobs(logits, asked, self.transfers), strict=True))
        outputs = self._commit(batch, drafted.trees, results, taps, lengths, lps)
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

    def sync(self) -> None:
        """Wait for the device (CUDA): stage times then measure device work, not the
        launches. One host sync; a no-op on CPU."""
        if self.device.type == "cuda":
            self.transfers.syncs += 1
            torch.cuda.synchronize(self.device)

    def _draft(self, batch: list[Request], budgets: list[Budget], lengths: list[int]) -> RoundDraft:
        """One drafter backbone pass for the batch, then the trees in depth waves."""
        block = self.drafter.config.block_size
        rows = [RowDraft(root=r.root, budget=b, depth_limit=min(block, r.params.max_tokens - len(r.output) - 1),
                         temperature=self.calibration.draft_temperature(r.params.temperature),
                         calibration=self.calibration.at(r.params.temperature), sampler=r.sampler)
                for r, b in zip(batch, budgets, strict=True)]
        base = None
        if any(not b.is_off and row.depth_limit > 0 for b, row in zip(budgets, rows, strict=True)):
            n, c = len(batch), max(lengths)
            ints = self.transfers.upload([[r.root for r in batch], lengths], torch.long)  # anchors, lengths
            base = self.drafter.block_logits(ints[0], self.kv.drafter.k[:, :n, :, :c],
                                             self.kv.drafter.v[:, :n, :, :c], ints[1])
        return self.waves.draft(base, rows)

    def _verify_forward(self, batch: list[Request], trees: list[DraftTree],
                        lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over every tree: logits [B, K, V] and taps, on the device."""
        b = tree_batch(trees, lengths, self.device, self.transfers.upload)
        out = self.runner.forward(b.tokens, b.positions, b.write_pos, self.kv.target, slice(0, len(batch)), b.mask)
        assert out.logits is not None
        return out.logits, out.taps

    def _accept(self, batch: list[Request], drafted: RoundDraft, logits: torch.Tensor) -> list[VerifyResult]:
        """Verify every tree on the device; one copy brings back the small results:
        the target's argmax at every node of greedy rows, the walk of sampled rows."""
        trees = drafted.trees
        greedy = [i for i, r in enumerate(batch) if r.params.temperature == 0]
        sampled = [i for i, r in enumerate(batch) if r.params.temperature > 0]
        parts = []
        if greedy:  # no copy of the logits: the argmax of every row, then the greedy rows'
            best = logits.argmax(-1)
            parts.append((best if len(greedy) == len(batch) else best[greedy]).flatten())
        if sampled:
            parts.append(self._walk(batch, drafted, logits, sampled).flatten())
        host = self.transfers.fetch(torch.cat(parts)).tolist()
        results: list[VerifyResult | None] = [None] * len(batch)
        kmax = logits.shape[1]
        for j, i in enumerate(greedy):
            results[i] = verify_greedy(trees[i], host[j * kmax: j * kmax + trees[i].num_nodes])
        at = len(greedy) * kmax
        width = (len(host) - at) // max(len(sampled), 1)
        for j, i in enumerate(sampled):
            row = host[at + j * width: at + (j + 1) * width]
            results[i] = walked(trees[i], [x for x in row[:-1] if x >= 0], row[-1])
        return results  # type: ignore[return-value]

    def _walk(self, batch: list[Request], drafted: RoundDraft, logits: torch.Tensor,
              sampled: list[int]) -> torch.Tensor:
        """The T > 0 rows' recursive rejection walk (``treespark.spec.walk``): the trees,
        the uniforms and the rows' parameters go up in two uploads."""
        trees = [drafted.trees[i] for i in sampled]
        r, width, depth = len(sampled), logits.shape[1], max(t.depth for t in trees)
        host = SampledTrees.host_arrays(trees, [drafted.draft_ids[i] for i in sampled],
                                        [drafted.q_row_of[i] for i in sampled], width)
        c = (host.shape[1] - 3 * width) // width
        # each request draws uniforms for its own tree's shape only (batch-independent)
        u = np.full((r, (depth + 1) * c + 1), 0.5)
        for j, (i, t) in enumerate(zip(sampled, trees, strict=True)):
            ci = branching(t)
            own = np.asarray(batch[i].sampler.uniform((t.depth + 1) * ci + 1))
            u[j, :-1].reshape(depth + 1, c)[: t.depth + 1, :ci] = own[:-1].reshape(t.depth + 1, ci)
            u[j, -1] = own[-1]
        params = [batch[i].params for i in sampled]
        # (top-p rounded to float32, the precision it has always been applied at)
        rowwise = np.array([[p.temperature, float(np.float32(p.top_p))] for p in params])
        floats = self.transfers.upload(np.concatenate([u, rowwise], 1), torch.float64)   # [R, ...]
        ints = self.transfers.upload(np.concatenate([np.asarray(sampled)[:, None], host], 1), torch.long)
        dev_trees = SampledTrees.unpack(ints[:, 1:], width, depth)
        top_p = floats[:, -1] if any(p.top_p < 1 for p in params) else None
        n_u = (depth + 1) * c
        return walk_sampled(logits, ints[:, 0], floats[:, -2], top_p, dev_trees, drafted.q_rows,
                            drafted.q_totals, self._d2t, floats[:, :n_u].view(r, depth + 1, c), floats[:, n_u])

    def _commit(self, batch: list[Request], trees: list[DraftTree], results: list[VerifyResult],
                taps: torch.Tensor, lengths: list[int],
                logprobs: dict[int, list[TokenLogprob]]) -> list[RequestOutput]:
        """Emit the rounds' tokens, keep the accepted nodes' KV entries next to the
        committed context, feed their taps to the drafter, retire finished requests."""
        # every row's root and accepted nodes move next to its committed context, and their
        # taps go to the drafter, in one upload and a few batched device operations (rows
        # that finish now too: their KV row is freed below, whatever it holds)
        keeps = [[0, *r.path] for r in results]
        rows = [i for i, keep in enumerate(keeps) for _ in keep]
        nodes = [n for keep in keeps for n in keep]
        slots = [req.slot for req, keep in zip(batch, keeps, strict=True) for _ in keep]
        src = [lengths[i] + n for i, n in zip(rows, nodes, strict=True)]
        dst = [lengths[i] + j for i, keep in enumerate(keeps) for j in range(len(keep))]
        m = len(rows)
        ints = self.transfers.upload([rows, nodes, slots, src, dst], torch.long)   # [5, M]
        kept_taps = taps[ints[0], ints[1]]                                        # [M, taps]
        self.kv.move_entries(ints[2], ints[3], ints[4])
        k, v = self.drafter.context_kv(kept_taps[None], ints[4][None])             # [L, 1, kvh, M, hd]
        self.kv.drafter.write_entries(ints[2], ints[4], k[:, 0], v[:, 0])
        outputs: list[RequestOutput] = []
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
            self.kv.lengths[req.slot] = lengths[i] + n
            req.root = result.tokens[-1]
        assert at == m
        for req in [r for r in batch if r.id not in self._ids]:
            self._release(req)
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

    def _release(self, req: Request) -> None:
        """Free a running request's row; the last running row moves into the gap."""
        i = self._running.index(req)
        last = len(self._running) - 1
        if i != last:
            self.kv.copy_row(last, i)
            self._running[i] = self._running[last]
            self._running[i].slot = i
        else:
            self.kv.free(i)
        self._running.pop()
        req.slot = -1

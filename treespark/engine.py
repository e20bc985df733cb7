"""The continuous-batching tree engine: many requests, one target forward per step.

Each ``step()``:

1. prefill: at most one chunk of one waiting request's prompt (in the KV cache's
   staging row), so new arrivals never starve running requests; its last chunk
   samples the first token at the request's own temperature;
2. draft: ONE drafter backbone pass for every running request, then a best-first
   tree per request under its budget (``treespark.expand``);
3. verify: ONE target forward over all trees (padded; each row sees its committed
   context and its tree ancestors), then the greedy walk or recursive rejection
   sampling per request (``treespark.verify``);
4. commit: move the accepted nodes' KV entries next to the committed context, feed
   their tapped hidden states to the drafter's context cache, and retire finished
   requests (their rows are freed at once; the last running row moves into the gap
   so the batch stays a contiguous view).

The engine is synchronous and not thread-safe: one thread owns it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from treespark.budget import Budget
from treespark.calibration import Calibration
from treespark.drafter import BlockProposal
from treespark.expand import Rank, expand
from treespark.kv import KVCache, StoreShape
from treespark.models import ModelPair
from treespark.params import RequestOutput, RequestStats, RoundStats, SamplingParams, StepStats
from treespark.sampling import TorchSampler, target_probs
from treespark.target import TargetRunner
from treespark.tree import DraftTree
from treespark.verify import verify_greedy, verify_sampled


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8         # running requests verified together
    max_context: int = 1024         # prompt + generated tokens per request
    max_tree_nodes: int = 64        # hard cap on draft nodes per tree, whatever the budget
    prefill_chunk: int = 256        # prompt tokens per prefill forward

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_context", "prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0")
        if self.max_tree_nodes < 0:
            raise ValueError("EngineConfig.max_tree_nodes must be >= 0")


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    sampler: TorchSampler
    budget: Budget | None                 # None: follow the engine's budget
    output: list[int] = field(default_factory=list)
    root: int = -1                        # the last emitted token, not yet in the KV
    slot: int = -1
    prefilled: int = 0
    rounds: list[RoundStats] = field(default_factory=list)

    def stats(self) -> RequestStats:
        drafted = sum(r.tree_size for r in self.rounds)
        return RequestStats(
            prompt_tokens=len(self.prompt),
            generated_tokens=len(self.output),
            rounds=len(self.rounds),
            drafted_tokens=drafted,
            accepted_tokens=sum(r.accepted for r in self.rounds),
            mean_tree_size=drafted / len(self.rounds) if self.rounds else 0.0,
            round_stats=tuple(self.rounds),
        )


class Engine:
    def __init__(
        self,
        pair: ModelPair,
        config: EngineConfig | None = None,
        *,
        budget: Budget | None = None,
        calibration: Calibration | None = None,
        rank: Rank = "calibrated",
    ) -> None:
        self.pair = pair
        self.config = config or EngineConfig()
        self.drafter = pair.drafter
        self.runner = TargetRunner(pair.target, self.drafter.config.target_layer_ids)
        self.device = self.runner.device
        dc = self.drafter.config
        self.kv = KVCache(
            self.runner.store_shape,
            StoreShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim),
            max_batch=self.config.max_batch_size,
            capacity=self.config.max_context + self.config.max_tree_nodes + 1,
            device=self.device,
            dtype=self.runner.dtype,
        )
        self.budget = budget or Budget.adaptive()
        self.calibration = calibration or pair.calibration
        self.rank: Rank = rank
        self._markov, self._d2t = BlockProposal.host_weights(self.drafter)
        self.on_step: Callable[[StepStats], None] | None = None
        self.vocab_size = self.runner.vocab_size
        self._waiting: deque[_Request] = deque()
        self._staging: _Request | None = None
        self._running: list[_Request] = []
        self._ids: set[str] = set()
        self._aborted: list[RequestOutput] = []

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    *, budget: Budget | None = None) -> None:
        """Queue a request; raises ValueError (saying what is wrong) if it can never run."""
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = validate_prompt(prompt_ids, self.vocab_size)
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if len(prompt) + params.max_tokens > self.config.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"engine's max_context of {self.config.max_context} tokens")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop token ids {bad_stop} are outside the vocabulary of {self.vocab_size}")
        self._ids.add(request_id)
        self._waiting.append(_Request(request_id, prompt, params, TorchSampler(params.seed), budget))

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

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._staging or self._aborted)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        prefill_tokens = self._prefill_step(outputs)
        if self._running:
            outputs += self._decode_step(t0, prefill_tokens)
        return outputs

    def _prefill_step(self, outputs: list[RequestOutput]) -> int:
        if self._staging is None:
            if not self._waiting or len(self._running) >= self.config.max_batch_size:
                return 0
            self._staging = self._waiting.popleft()
            self._staging.slot = self.kv.staging
        req = self._staging
        start = req.prefilled
        end = min(len(req.prompt), start + self.config.prefill_chunk)
        last = end == len(req.prompt)
        dev = self.device
        tokens = torch.tensor([req.prompt[start:end]], device=dev)
        pos = torch.arange(start, end, device=dev)[None]
        mask = (torch.arange(end, device=dev)[None, :] <= pos[0][:, None])[None, None]
        logits_at = torch.zeros_like(tokens, dtype=torch.bool)
        logits_at[0, -1] = last
        rows = slice(req.slot, req.slot + 1)
        out = self.runner.forward(tokens, pos, pos, self.kv.target, rows, mask, logits_at)
        self._write_context(req.slot, out.taps[0], pos[0])
        req.prefilled = end
        self.kv.lengths[req.slot] = end
        if last:
            self._staging = None
            assert out.logits is not None
            first = self._sample_first(req, out.logits[0, -1])
            done = self._emit(req, [first], outputs, is_prefill=True)
            if done:
                self.kv.free(req.slot)
            else:
                row = len(self._running)
                self.kv.copy_row(req.slot, row)
                req.slot = row
                self._running.append(req)
        return end - start

    def _sample_first(self, req: _Request, logits: torch.Tensor) -> int:
        """The first token after prefill, at the request's temperature (never argmax at T > 0)."""
        if req.params.temperature == 0:
            return int(logits.argmax())
        p = target_probs(logits, req.params.temperature, req.params.top_p)
        return req.sampler.categorical(p)

    def _write_context(self, slot: int, taps: torch.Tensor, pos: torch.Tensor) -> None:
        """Feed committed positions' tapped hidden states to the drafter's context cache."""
        k, v = self.drafter.context_kv(taps[None].to(self.drafter.fc.weight.dtype), pos[None])
        self.kv.drafter.write_all(slice(slot, slot + 1), pos[None], k, v)

    def _row_budget(self, req: _Request) -> Budget:
        b = req.budget or self.budget
        cap = min(b.node_cap, self.config.max_tree_nodes)
        return b if cap == b.node_cap else Budget(b.theta, cap, b.branch_cap)

    def _decode_step(self, t0: float, prefill_tokens: int) -> list[RequestOutput]:
        batch = list(self._running)
        n = len(batch)
        dev = self.device
        lengths = torch.tensor([self.kv.lengths[r.slot] for r in batch], device=dev)
        rows = slice(0, n)
        assert all(r.slot == i for i, r in enumerate(batch)), "running rows must be compact"

        # draft: one backbone pass for the batch, then one tree per request
        t_draft = time.perf_counter()
        c = int(lengths.max())
        budgets = [self._row_budget(r) for r in batch]
        depths = [r.params.max_tokens - len(r.output) - 1 for r in batch]
        trees: list[DraftTree] = []
        if all(b.is_off or d <= 0 for b, d in zip(budgets, depths, strict=True)):
            # nobody speculates this step: skip the drafter, verify the roots alone
            trees = [DraftTree.root_only(r.root) for r in batch]
        else:
            anchors = torch.tensor([r.root for r in batch], device=dev)
            ctx_k = self.kv.drafter.k[:, rows, :, :c]
            ctx_v = self.kv.drafter.v[:, rows, :, :c]
            base = self.drafter.block_logits(anchors, ctx_k, ctx_v, lengths).cpu()
            for i, req in enumerate(batch):
                trees.append(expand(
                    BlockProposal(base[i], self._markov, self._d2t), req.root, budgets[i],
                    self.calibration, req.params.temperature, req.sampler,
                    max_depth=depths[i], rank=self.rank))
        draft_s = time.perf_counter() - t_draft

        # verify: one target forward over every tree
        t_verify = time.perf_counter()
        kmax = max(t.num_nodes for t in trees)
        tokens = torch.zeros(n, kmax, dtype=torch.long)
        offsets = torch.zeros(n, kmax, dtype=torch.long)
        tree_mask = torch.zeros(n, kmax, kmax, dtype=torch.bool)
        for i, t in enumerate(trees):
            k = t.num_nodes
            tokens[i, :k] = torch.tensor(t.tokens)
            offsets[i, :k] = t.position_offsets()
            tree_mask[i, :k, :k] = t.ancestor_mask()
            tree_mask[i, k:, 0] = True  # padding rows see the root only (no all-masked rows)
        tokens, offsets, tree_mask = tokens.to(dev), offsets.to(dev), tree_mask.to(dev)
        lens = lengths[:, None]
        positions = lens + offsets
        write_pos = lens + torch.arange(kmax, device=dev)[None]
        total = c + kmax
        cols = torch.arange(total, device=dev)[None, None, :]                 # [1, 1, T]
        in_ctx = cols < lens[:, :, None]                                      # [B, 1, T]
        rel = cols - lens[:, :, None]                                         # tree slot of a column
        in_tree = (rel >= 0) & (rel < kmax)
        tree_cols = torch.gather(tree_mask, 2, rel.clamp(0, kmax - 1).expand(n, kmax, total))
        mask = (in_ctx.expand(n, kmax, total) | (in_tree & tree_cols))[:, None]
        out = self.runner.forward(tokens, positions, write_pos, self.kv.target, rows, mask)
        assert out.logits is not None
        logits = out.logits.cpu()

        outputs: list[RequestOutput] = []
        records: list[tuple[float, bool, int]] = []
        sampled_records: list[tuple[float, bool, int]] = []
        accepted: list[int] = []
        commit_taps, commit_pos, commit_slot = [], [], []
        for i, (req, tree) in enumerate(zip(batch, trees, strict=True)):
            row_logits = logits[i, : tree.num_nodes]
            if req.params.temperature == 0:
                result = verify_greedy(tree, row_logits.argmax(-1).tolist())
                records += result.records
            else:
                probs = target_probs(row_logits, req.params.temperature, req.params.top_p)
                result = verify_sampled(tree, probs, req.sampler)
                sampled_records += result.records
            accepted.append(result.accepted)
            req.rounds.append(RoundStats(tree.size, tree.depth, tree.width, result.accepted,
                                         (req.budget or self.budget).theta))
            length = self.kv.lengths[req.slot]
            done = self._emit(req, list(result.tokens), outputs)
            if done:
                continue
            keep = [0, *result.path]
            self.kv.move_entries(req.slot, [length + s for s in keep], [length + j for j in range(len(keep))])
            commit_taps.append(out.taps[i, keep])
            commit_pos.append(torch.arange(length, length + len(keep), device=dev))
            commit_slot.append(req.slot)
            self.kv.lengths[req.slot] = length + len(keep)
            req.root = result.tokens[-1]
        if commit_taps:
            flat_k, flat_v = self.drafter.context_kv(torch.cat(commit_taps)[None],
                                                      torch.cat(commit_pos)[None])
            at = 0
            for slot, pos in zip(commit_slot, commit_pos, strict=True):
                m = pos.numel()
                self.kv.drafter.write_all(slice(slot, slot + 1), pos[None],
                                          flat_k[:, :, :, at:at + m], flat_v[:, :, :, at:at + m])
                at += m
        for req in [r for r in batch if r.id not in self._ids]:
            self._release(req)
        verify_s = time.perf_counter() - t_verify

        if self.on_step is not None:
            self.on_step(StepStats(
                batch_size=n,
                tokens_verified=sum(t.num_nodes for t in trees),
                tree_sizes=tuple(t.size for t in trees),
                depths=tuple(t.depth for t in trees),
                widths=tuple(t.width for t in trees),
                accepted=tuple(accepted),
                theta=self.budget.theta,
                draft_s=draft_s,
                verify_s=verify_s,
                step_s=time.perf_counter() - t0,
                prefill_tokens=prefill_tokens,
                calibration_records=tuple(records),
                sampled_records=tuple(sampled_records),
                node_caps=tuple(b.node_cap for b in budgets),
            ))
        return outputs

    def _emit(self, req: _Request, tokens: list[int], outputs: list[RequestOutput],
              is_prefill: bool = False) -> bool:
        """Append emitted tokens, applying stop tokens and max_tokens; True if finished."""
        reason = None
        room = req.params.max_tokens - len(req.output)
        if len(tokens) >= room:
            tokens, reason = tokens[:room], "length"
        stops = set(req.params.stop_token_ids)
        for j, t in enumerate(tokens):
            if t in stops:
                tokens, reason = tokens[: j + 1], "stop"
                break
        req.output += tokens
        if is_prefill and reason is None:
            req.root = tokens[-1]
        finished = reason is not None
        if finished:
            self._ids.discard(req.id)
        outputs.append(RequestOutput(req.id, tokens, finished, reason, req.stats() if finished else None))
        return finished

    def _release(self, req: _Request) -> None:
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


def validate_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """Check a prompt: a non-empty list of integer token ids inside the vocabulary."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise ValueError("prompt_ids must be a list of token ids")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: at least one token is needed")
    prompt = []
    for t in prompt_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_floating_point():
                t = int(t)
            else:
                raise ValueError(f"prompt_ids must hold integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} is outside the vocabulary (0..{vocab_size - 1})")
        prompt.append(int(t))
    return prompt

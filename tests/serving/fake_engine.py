"""A fake ``treespark.engine.core.Engine`` with the same contract (and the engine's own
request and step types), for serving tests that isolate the deployments from the model:
deterministic tokens (``prev + 1 mod V``), ``1 + min(node_cap, 2)`` tokens per round, an
optional sleep per step; no prefix cache (its queries count, its hits stay 0)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.replica.engine_factory import EngineBundle
from deployments.replica.text import ByteTokenizer
from treespark.spec.budget import Budget
from treespark.spec.calibration import Calibration
from treespark.spec.params import RequestOutput, RequestStats, SamplingParams, StepStats


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


class FakeEngine:
    def __init__(self, vocab_size: int = 512, max_batch_size: int = 8, max_context: int = 1024, step_sleep_s: float = 0.0):
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.step_sleep_s = step_sleep_s
        self.budget = Budget.adaptive()
        self.on_step = None
        self.on_schedule = None  # the optional hook: called with a request id leaving the waiting queue
        self._running: dict[str, _Req] = {}
        self._waiting: list[_Req] = []
        self._aborted: list[str] = []
        self.aborted_ids: list[str] = []
        self.calibration = Calibration()
        # the engine's counters: every admitted prompt is looked up, none is cached, none preempted
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """A fake's measure: the fraction of batch rows in use (it has no KV blocks)."""
        return len(self._running) / self.max_batch_size

    def add_request(self, request_id, prompt_ids, params):
        if not prompt_ids:
            raise ValueError("empty prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError("prompt token id out of vocabulary")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise ValueError("prompt + max_tokens exceeds max_context")
        self._waiting.append(_Req(request_id, list(prompt_ids), params))

    def abort(self, request_id):
        self._running.pop(request_id, None)
        self._waiting = [r for r in self._waiting if r.rid != request_id]
        self._aborted.append(request_id)
        self.aborted_ids.append(request_id)

    def has_unfinished(self):
        return bool(self._running or self._waiting or self._aborted)

    def set_budget(self, budget):
        self.budget = budget

    def set_calibration(self, a, b):
        self.calibration = self.calibration.with_ab(a, b)

    def step(self):
        t0 = time.perf_counter()
        outs = [RequestOutput(r, [], True, "abort", None) for r in self._aborted]
        self._aborted = []
        while self._waiting and len(self._running) < self.max_batch_size:
            r = self._waiting.pop(0)
            self._running[r.rid] = r
            self.prefix_cache_queries += len(r.prompt)
            if self.on_schedule is not None:
                self.on_schedule(r.rid)
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        k = 1 + min(self.budget.node_cap, 2)
        accepted = []
        for r in list(self._running.values()):
            new, reason = [], None
            for _ in range(k):
                prev = (r.out or r.prompt)[-1]
                tok = (prev + 1) % self.vocab_size
                new.append(tok)
                r.out.append(tok)
                if tok in r.params.stop_token_ids:
                    reason = "stop"
                    break
                if len(r.out) >= r.params.max_tokens:
                    reason = "length"
                    break
            r.rounds += 1
            r.drafted += self.budget.node_cap
            r.accepted += len(new) - 1
            accepted.append(len(new) - 1)
            stats = None
            if reason:
                del self._running[r.rid]
                stats = RequestStats(len(r.prompt), len(r.out), r.rounds, r.drafted, r.accepted, float(self.budget.node_cap))
            outs.append(RequestOutput(r.rid, new, reason is not None, reason, stats))
        n = len(accepted)
        dt = time.perf_counter() - t0
        if self.on_step is not None:
            cap = self.budget.node_cap
            self.on_step(StepStats(
                batch_size=n, tokens_verified=n * (1 + cap), tree_sizes=(cap,) * n, depths=(min(cap, 2),) * n,
                widths=(self.budget.branch_cap,) * n, accepted=tuple(accepted), theta=self.budget.theta,
                draft_s=0.0, verify_s=dt, step_s=dt,
                calibration_records=((0.5, True, 0), (0.2, False, 1)) if n else (),
                sampled_records=((0.3, True, 0),) if n else (), node_caps=(cap,) * n))
        return outs


def build_fake_engine(args, step_sleep_s: float = 0.01):
    """``engine_factory`` for ``AppArgs``: a FakeEngine with a byte tokenizer."""
    engine = FakeEngine(args.vocab_size, args.max_batch_size, args.max_context, step_sleep_s=step_sleep_s)
    return EngineBundle(engine=engine, tokenizer=ByteTokenizer(args.vocab_size), make_params=SamplingParams, eos_token_ids=())


def build_fake_engine_with_sampled_map(args, step_sleep_s: float = 0.01):
    """As ``build_fake_engine``, its calibration holding a sampled map of its own."""
    bundle = build_fake_engine(args, step_sleep_s)
    bundle.engine.calibration = Calibration(1.0, 0.0, sampled=Calibration(0.5, -1.0))
    return bundle

"""Request-level types shared by the engine, ``generate`` and the serving layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from treespark.spec.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from treespark.spec.sampling import validate_temperature, validate_top_p

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. At T > 0 a request is verified by recursive rejection
    sampling (``treespark.spec.walk``) unless it is ``reproducible``: then each token is
    the Gumbel-max draw keyed by (seed, its index in the sequence) (``treespark.spec.gumbel``),
    a function of the prompt and the seed alone, whatever the draft trees, the batch,
    preemption, or a resumed stream (the prompt and the tokens sent, with the same seed).
    Both have exactly the target's distribution; the walk accepts more draft tokens."""

    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None           # None = a fresh random stream
    logprobs: int | None = None       # None: none; k: each emitted token's log-prob and the k likeliest
    reproducible: bool = False        # T > 0: tokens a function of (prompt, seed) alone; needs a seed

    def __post_init__(self) -> None:
        validate_temperature(self.temperature)
        validate_top_p(self.top_p)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.reproducible, bool):
            raise ValueError(f"reproducible must be a bool, got {self.reproducible!r}")
        if self.reproducible and self.temperature > 0 and self.seed is None:
            raise ValueError("reproducible sampling at temperature > 0 needs a seed")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def keyed(self) -> bool:
        """Sampled with position-keyed Gumbel noise (reproducible at T > 0); T = 0 is
        greedy whatever the switch."""
        return self.reproducible and self.temperature > 0


@dataclass(frozen=True)
class RoundStats:
    """One speculative round of one request."""

    tree_size: int    # draft nodes verified (root excluded)
    depth: int
    width: int
    accepted: int     # draft tokens accepted (the emitted target token excluded)
    theta: float


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_tree_size: float
    round_stats: tuple[RoundStats, ...] = ()

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per target forward of this request (tau)."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort"
    stats: RequestStats | None = None  # set when finished
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token, when the request asked
    # when finished and the request asked (capture_taps): the target's tapped hidden states
    # [prompt + output - 1, n_taps * hidden] float16 on the host, one row per position before
    # the last token, from the forwards that generated them (what the drafter trains on)
    taps: torch.Tensor | None = None


@dataclass(frozen=True)
class StepStats:
    """One engine step (one target forward over the running batch)."""

    batch_size: int
    tokens_verified: int
    tree_sizes: tuple[int, ...]
    depths: tuple[int, ...]
    widths: tuple[int, ...]
    accepted: tuple[int, ...]
    theta: float
    draft_s: float
    verify_s: float
    step_s: float
    prefill_tokens: int = 0
    calibration_records: tuple[tuple[float, bool, int], ...] = ()  # (q, accepted, sibling rank), T = 0 rows
    sampled_records: tuple[tuple[float, bool, int], ...] = ()      # the same, T > 0 rows of the walk
    node_caps: tuple[int, ...] = ()  # each row's budget node cap (after max_tree_nodes)
    draft_waves: int = 0             # batched drafter calls that grew the trees (one per depth level)
    host_syncs: int = 0              # device-to-host copies (and CUDA waits) in the step
    host_elements: int = 0           # numbers those copies brought back
    host_uploads: int = 0            # host-to-device copies in the step (non-blocking on CUDA)
    policy_s: float = 0.0            # the per-step allocation's CPU seconds (its calls are inside draft_s)

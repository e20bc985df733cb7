"""Randomness and target distributions.

Every random draw in TreeSpark goes through a ``Sampler``, one per request, built on
an explicit CPU ``torch.Generator`` (never the global RNG). The host reference path
(``treespark.spec.expand``, ``treespark.spec.verify``) calls ``categorical`` and ``bernoulli``, so
exact tests can replace it by a sampler that enumerates every outcome with its
probability; the engine's device path takes plain uniforms (``uniform``) and turns them
into draws on the device by inverse CDF, so a seeded request draws the same tokens on
CPU and CUDA.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Sampler(Protocol):
    def categorical(self, probs: torch.Tensor) -> int:
        """Draw an index from ``probs`` ([V], non-negative, summing to 1)."""
        ...

    def bernoulli(self, p: float) -> bool:
        """True with probability ``p``."""
        ...

    def uniform(self, n: int) -> list[float]:
        """``n`` independent uniforms in [0, 1)."""
        ...


class TorchSampler:
    """A request's sampler: one CPU ``torch.Generator``, seeded or fresh."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def categorical(self, probs: torch.Tensor) -> int:
        probs = probs.detach().to("cpu", torch.float64)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())

    def bernoulli(self, p: float) -> bool:
        if p >= 1.0:
            # still consume one draw so the stream does not depend on p's value
            torch.rand((), generator=self.generator, dtype=torch.float64)
            return True
        return bool(torch.rand((), generator=self.generator, dtype=torch.float64).item() < p)

    def uniform(self, n: int) -> list[float]:
        return torch.rand(n, generator=self.generator, dtype=torch.float64).tolist()


def validate_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if math.isnan(temperature) or temperature < 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    return float(temperature)


def validate_top_p(top_p: float) -> float:
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or math.isnan(top_p):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(top_p)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution the output must follow: softmax(logits / T), nucleus-filtered.

    logits: [..., V] -> probabilities [..., V] in float64 (exact tests need the precision).
    """
    assert temperature > 0, "greedy decoding uses argmax, not probabilities"
    x = logits.to(torch.float64)
    # shift first: a tiny temperature then gives -inf (not NaN) off the argmax
    probs = torch.softmax((x - x.amax(-1, keepdim=True)) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def target_probs_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """``target_probs`` with one temperature (and top-p) per row, on the logits' device.

    logits: [R, V]; temperature, top_p: [R] (every T > 0, float64 so that the smallest
    survive; top_p None: 1 everywhere)
    -> [R, V] float64."""
    x = logits.to(torch.float64, copy=True)                    # worked on in place
    x.sub_(x.amax(-1, keepdim=True)).div_(temperature.to(x)[:, None]).exp_()
    probs = x.div_(x.sum(-1, keepdim=True))
    if top_p is not None:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p.to(x)[:, None]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row by inverse CDF: probs [R, V] (non-negative, summing to 1),
    u [R] uniforms in [0, 1) -> [R] long. Zero-probability tokens are never drawn."""
    c = probs.cumsum(-1)
    x = torch.searchsorted(c, (u.to(c) * c[:, -1])[:, None], right=True)[:, 0]
    return x.clamp(max=probs.shape[-1] - 1)


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The drafter's distribution q at a temperature (T = 0 ranks with T = 1)."""
    t = temperature if temperature > 0 else 1.0
    x = logits.to(torch.float32)
    return torch.softmax((x - x.amax(-1, keepdim=True)) / t, dim=-1)

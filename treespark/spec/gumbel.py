"""Position-keyed Gumbel noise: sampled tokens that are a function of (prompt, seed) alone.

Terms. A *reproducible* request (``SamplingParams.reproducible``) samples the token at
absolute sequence *index* n (the number of tokens before it: prompt and output so far) as

    x_n = argmax_v ( logits_n[v] / T + G(seed, n, v) )     over the top-p nucleus,

the Gumbel-max trick (Gumbel 1954; Maddison et al. 2014, "A* sampling"): with G
independent standard Gumbel variables, x_n is an exact draw from softmax(logits_n / T)
(nucleus-filtered). The noise ``G(seed, n, v) = -log(-log U(seed, n, v))`` is *keyed*:
U is a counter-based hash of (seed, n, v) to a uniform in (0, 1) (Salmon et al. 2011,
"Parallel random numbers: as easy as 1, 2, 3"), so a token's noise depends on nothing
but its position and its id. The sequence has exactly the target's distribution (each
x_n's noise is independent of everything before it), and which tokens a seed gets never
depends on the draft trees, the batch, preemption, or where a resumed stream restarts.

Speculative decoding then *couples* the drafter to the target through the same noise
(Gumbel-max coupling: Daliri, Musco and Suresh 2024, "Coupling without communication and
drafter-invariant speculative decoding"; a draft equals the target's draw with
probability at least (1 - TV) / (1 + TV), below rejection sampling's 1 - TV): a
node's children are the top-k of ``log q / T_draft + G`` over the draft vocabulary
(Gumbel-top-k, which is sampling without replacement from q: Kool et al. 2019,
"Stochastic beams and where to find them"), and verification is greedy verification on
the target's perturbed argmax at each node. Which tokens are emitted never depends on
the drafts; the drafts only decide how many of them one target forward emits.

The hash: ``mix32`` is Wellons' ``lowbias32`` 32-bit avalanche (hash-prospector), on
int64 tensors holding 32-bit values. Every product is a 32-bit value times a constant
below 2**31 (the one constant above is applied as (c - 2**31) plus a shift), so nothing
exceeds 63 bits: no signed overflow, and the same integers on CPU and CUDA. Two keys
per (seed, n), each seed word and the index folded in by ``mix32``; per token, two
32-bit hashes of the premixed token id under the two keys give 52 bits m, and
U = (2m + 1) / 2**53: the midpoint of one of 2**52 equal cells, never 0 or 1, exact in
float64. Indices and token ids must be below 2**32; a seed is taken modulo 2**64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespark.spec.sampling import target_probs_rows

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D             # lowbias32's multipliers (the second is 2**31 + _M2_LOW)
_M2_LOW = 0x846CA68B - (1 << 31)
_STREAMS = (0x243F6A88, 0x85A308D3)  # the two keys' starting words (pi's first hex digits)
_CELLS = 2.0 ** -53
CACHE_ELEMENTS = 1 << 18   # elements of one CPU slice's [rows, slice] tensors (2 MiB of int64)
DEVICE_ELEMENTS = 1 << 26  # on an accelerator (512 MiB of float64: 441 nodes of a 151,936 vocabulary)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values in [0, 2**32), elementwise: a bijection of 32-bit words
    whose every output bit flips with probability ~1/2 when any input bit flips."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32                                    # < 2**32 * 2**31
    x = x ^ (x >> 15)
    x = (x * _M2_LOW + ((x & 1) << 31)) & MASK32              # x * 0x846ca68b mod 2**32
    return x ^ (x >> 16)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed modulo 2**64 as its low and high 32-bit words (host integers)."""
    s = int(seed) % (1 << 64)
    return s & MASK32, s >> 32


@dataclass(frozen=True)
class PositionKey:
    """Where a reproducible request's noise comes from this step: its seed's two 32-bit
    words and ``next_index``, the absolute index of its next token (prompt and output so
    far). A draft node at depth d holds the token at ``next_index + d - 1``."""

    seed_lo: int
    seed_hi: int
    next_index: int

    @classmethod
    def of(cls, seed: int, next_index: int) -> PositionKey:
        assert 0 <= next_index < 1 << 32, "indices are 32-bit words"
        return cls(*seed_words(seed), next_index)


def position_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The two 32-bit keys of each (seed, index): seed_lo, seed_hi, index [...] int64
    (words and indices in [0, 2**32)) -> [..., 2] int64."""
    keys = []
    for stream in _STREAMS:
        k = mix32(seed_lo ^ stream)
        k = mix32(k ^ seed_hi)
        keys.append(mix32(k ^ index))
    return torch.stack(keys, -1)


def keyed_uniforms(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """U(seed, n, v) for every key and token: keys [..., 2] int64 (``position_keys``),
    tokens [V] int64 ids in [0, 2**32) -> [..., V] float64 in (0, 1)."""
    t = mix32(tokens)                                                      # [V]
    h1 = mix32(t ^ keys[..., :1])                                          # [..., V]
    h2 = mix32(t ^ keys[..., 1:])
    m = (h1 << 20) | (h2 >> 12)                                            # 52 bits
    return (2 * m + 1).to(torch.float64) * _CELLS


def keyed_gumbel(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """G(seed, n, v) = -log(-log U): keys [..., 2], tokens [V] -> [..., V] float64, each a
    standard Gumbel variable (in [-3.6, 36.7]: U's cells keep it finite)."""
    u = keyed_uniforms(keys, tokens)
    return u.log_().neg_().log_().neg_()


def _vocab_slices(rows: int, vocab: int, device: torch.device) -> list[slice]:
    """The vocabulary in the slices ``keyed_argmax`` and ``keyed_top_k`` work through: on the
    CPU, slices whose [rows, slice] tensors fit the cache (the hash is a chain of cheap
    elementwise ops, memory-bound op by op: the noise of a [56, 49,152] block took 374 ms
    whole and 49 ms in slices of 4,096 tokens, on a shared two-core EPYC); on an
    accelerator, as few slices as keep each float64 [rows, slice] tensor within
    ``DEVICE_ELEMENTS`` (each slice costs its kernel launches; one at most batches)."""
    budget = CACHE_ELEMENTS if device.type == "cpu" else DEVICE_ELEMENTS
    width = max(budget // max(rows, 1), 512)
    return [slice(s, min(s + width, vocab)) for s in range(0, vocab, width)]


def keyed_argmax(
    logits: torch.Tensor,        # [N, V] the target's logits at N nodes
    temperature: torch.Tensor,   # [N] float64, every one > 0
    top_p: torch.Tensor | None,  # [N] (None: 1 for every row)
    keys: torch.Tensor,          # [M, 2] int64 ``position_keys`` of the indices drawn at
    key_of: torch.Tensor,        # [N] long: the row of ``keys`` of each node's next index
) -> torch.Tensor:
    """The Gumbel-max draw at each node from the target's distribution at T and top-p
    (``treespark.spec.sampling.target_probs_rows``'s): argmax over the nucleus of
    (logits - max) / T + G -> [N] long. Shifted first, so a tiny temperature gives -inf,
    not NaN, off the argmax. Nodes that share an index (siblings' children, in a tree)
    share ``keys``' row: the hash runs over [M, V], the scores over [N, V]. Rows with
    top_p = 1 are never filtered, so a row's draw does not depend on the other rows'."""
    n, vocab = logits.shape
    dev = logits.device
    shift = logits.amax(-1).to(torch.float64)[:, None]                           # [N, 1]
    t = temperature.to(torch.float64)[:, None]
    outside = None
    if top_p is not None:
        outside = (target_probs_rows(logits, temperature, top_p) == 0) & (top_p < 1)[:, None]   # [N, V]
    tokens = torch.arange(vocab, device=dev)
    best = torch.full((n,), float("-inf"), dtype=torch.float64, device=dev)
    arg = torch.zeros(n, dtype=torch.long, device=dev)
    for s in _vocab_slices(max(n, keys.shape[0]), vocab, dev):
        z = logits[:, s].to(torch.float64).sub_(shift).div_(t)               # [N, c]
        z.add_(keyed_gumbel(keys, tokens[s])[key_of])
        if outside is not None:
            z.masked_fill_(outside[:, s], float("-inf"))
        value, at = z.max(-1)
        better = value > best                                                    # ties: the lower id
        best = torch.where(better, value, best)
        arg = torch.where(better, at + s.start, arg)
    return arg


def keyed_top_k(
    log_q: torch.Tensor,    # [S, Vd] a drafting distribution's scaled log-probabilities (up to a row constant)
    keys: torch.Tensor,     # [S, 2] int64 ``position_keys`` of the index the children are drawn at
    tokens: torch.Tensor,   # [Vd] int64 the token id of each draft index (the noise is the target's token's)
    k: int,
) -> torch.Tensor:
    """Gumbel-top-k: the indices of the k largest log_q + G(seed, n, token) in decreasing
    order -> [S, k] long, k draws without replacement from softmax(log_q), in draw order
    (Kool et al. 2019). Each slice's top k, then the top k of those."""
    vals, ids = [], []
    for s in _vocab_slices(log_q.shape[0], log_q.shape[1], log_q.device):
        z = log_q[:, s].to(torch.float64).add_(keyed_gumbel(keys, tokens[s]))   # [S, c]
        top = z.topk(min(k, z.shape[1]), dim=-1)
        vals.append(top.values)
        ids.append(top.indices + s.start)
    assert k <= log_q.shape[1], "k draws without replacement need k tokens"
    vals_all, ids_all = torch.cat(vals, 1), torch.cat(ids, 1)
    return ids_all.gather(1, vals_all.topk(k, dim=-1).indices)

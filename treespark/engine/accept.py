"""The target's logits to tokens: verification's device work and its one copy back
(which draft nodes each row keeps), and a prefill's first tokens.

After the target forward over every tree (``treespark.engine.core``, step 3), greedy
rows take the target's argmax at every node; reproducible sampled rows (*keyed* rows,
``SamplingParams.reproducible``) the Gumbel-max draw at every node, its noise keyed by
the index of the token drawn (``treespark.spec.gumbel``), which greedy verification then
walks as it walks the argmax; the other sampled rows run the recursive rejection walk
on the device (``treespark.spec.walk``), their uniforms drawn per request for its own
tree's shape (batch-independent). One copy brings all of it to the host, where
``treespark.spec.verify`` turns it into each row's accepted path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from treespark.engine.request import Request
from treespark.kernels import vocab
from treespark.kernels.transfer import HostTransfers
from treespark.spec.drafting import RoundDraft
from treespark.spec.gumbel import keyed_argmax, position_keys, seed_words
from treespark.spec.sampling import sample_rows, target_probs_rows
from treespark.spec.verify import VerifyResult, verify_greedy, walked
from treespark.spec.walk import SampledTrees, branching, walk_level, walk_sampled


def accept(batch: list[Request], drafted: RoundDraft, logits: torch.Tensor, transfers: HostTransfers,
           d2t: torch.Tensor | None, level: Callable = walk_level) -> list[VerifyResult]:
    """Verify every tree on the device; one copy brings back the small results:
    the target's argmax at every node of greedy rows, the keyed draw at every node of
    keyed rows, the walk of sampled rows (each depth a call of ``level``: ``walk_level``
    or a compiled copy)."""
    trees = drafted.trees
    greedy = [i for i, r in enumerate(batch) if r.params.temperature == 0]
    keyed = [i for i, r in enumerate(batch) if r.params.keyed]
    sampled = [i for i, r in enumerate(batch) if r.params.temperature > 0 and not r.params.keyed]
    parts = []
    if greedy:  # no copy of the logits: the argmax of every row (B x K small ints; picking
        # the greedy rows on the device would upload their indices, a blocking copy on CUDA)
        parts.append(vocab.argmax(logits).flatten())
    if keyed:
        parts.append(_keyed(batch, drafted, logits, keyed, transfers))
    if sampled:
        parts.append(_walk(batch, drafted, logits, sampled, transfers, d2t, level).flatten())
    host = transfers.fetch(torch.cat(parts)).tolist()
    results: list[VerifyResult | None] = [None] * len(batch)
    kmax = logits.shape[1]
    for i in greedy:
        results[i] = verify_greedy(trees[i], host[i * kmax: i * kmax + trees[i].num_nodes])
    at = len(batch) * kmax if greedy else 0
    for j, i in enumerate(keyed):
        results[i] = verify_greedy(trees[i], host[at + j * kmax: at + j * kmax + trees[i].num_nodes])
    at += len(keyed) * kmax
    width = (len(host) - at) // max(len(sampled), 1)
    for j, i in enumerate(sampled):
        row = host[at + j * width: at + (j + 1) * width]
        results[i] = walked(trees[i], [x for x in row[:-1] if x >= 0], row[-1])
    return results  # type: ignore[return-value]


def _keyed(batch: list[Request], drafted: RoundDraft, logits: torch.Tensor, keyed: list[int],
           transfers: HostTransfers) -> torch.Tensor:
    """The keyed rows' Gumbel-max draw at every node ([G * K] long): node i at depth d
    draws the token at index ``next_index + d``; a row's nodes at one depth share their
    noise. Per row its batch row, seed words, next index, temperature, top-p and its
    nodes' depths go up in one upload (integers below 2**53 are exact in float64)."""
    g, kmax = len(keyed), logits.shape[1]
    depth = np.zeros((g, kmax), dtype=np.int64)
    for j, i in enumerate(keyed):
        t = drafted.trees[i]
        depth[j, :t.num_nodes] = t.depths
    levels = int(depth.max()) + 1
    params = [batch[i].params for i in keyed]
    rowwise = np.array([[i, *seed_words(p.seed), batch[i].next_index, p.temperature, float(np.float32(p.top_p))]
                        for i, p in zip(keyed, params, strict=True)], dtype=np.float64)
    up = transfers.upload(np.concatenate([rowwise, depth], 1), torch.float64)      # [G, 6 + K]
    ints = up[:, :4].long()
    index = ints[:, 3:4] + torch.arange(levels, device=logits.device)              # [G, levels]
    keys = position_keys(ints[:, 1:2], ints[:, 2:3], index).view(g * levels, 2)
    key_of = (torch.arange(g, device=logits.device)[:, None] * levels + up[:, 6:].long()).view(-1)   # [G * K]
    top_p = up[:, 5].repeat_interleave(kmax) if any(p.top_p < 1 for p in params) else None
    node_logits = logits[ints[:, 0]].view(g * kmax, -1)                            # [G * K, V]
    return keyed_argmax(node_logits, up[:, 4].repeat_interleave(kmax), top_p, keys, key_of)


def _walk(batch: list[Request], drafted: RoundDraft, logits: torch.Tensor, sampled: list[int],
          transfers: HostTransfers, d2t: torch.Tensor | None, level: Callable) -> torch.Tensor:
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
    floats = transfers.upload(np.concatenate([u, rowwise], 1), torch.float64)   # [R, ...]
    ints = transfers.upload(np.concatenate([np.asarray(sampled)[:, None], host], 1), torch.long)
    dev_trees = SampledTrees.unpack(ints[:, 1:], width, depth)
    top_p = floats[:, -1] if any(p.top_p < 1 for p in params) else None
    n_u = (depth + 1) * c
    return walk_sampled(logits, ints[:, 0], floats[:, -2], top_p, dev_trees, drafted.q_rows,
                        drafted.q_totals, d2t, floats[:, :n_u].view(r, depth + 1, c), floats[:, n_u], level)


def sample_firsts(reqs: list[Request], logits: torch.Tensor, transfers: HostTransfers) -> list[int]:
    """The first token after prefill of each request (logits [R, V]), at its own
    temperature (never argmax at T > 0: one uniform from its own generator, or a keyed
    row's Gumbel-max draw at its index), in one upload and one copy."""
    tokens = vocab.argmax(logits)
    sampled = [i for i, r in enumerate(reqs) if r.params.temperature > 0 and not r.params.keyed]
    keyed = [i for i, r in enumerate(reqs) if r.params.keyed]
    if sampled or keyed:
        # one upload: per sampled row its index, temperature, uniform and top-p, then per
        # keyed row its index, temperature, top-p, seed words and index (top-p rounded to
        # float32, the precision it has always been applied at)
        rows = [[i, reqs[i].params.temperature, reqs[i].sampler.uniform(1)[0], float(np.float32(reqs[i].params.top_p))]
                for i in sampled]
        rows_k = [[i, reqs[i].params.temperature, float(np.float32(reqs[i].params.top_p)),
                   *seed_words(reqs[i].params.seed), reqs[i].next_index] for i in keyed]
        up = transfers.upload(np.concatenate([np.asarray(rows, dtype=np.float64).ravel(),
                                              np.asarray(rows_k, dtype=np.float64).ravel()]), torch.float64)
        if sampled:
            x = up[:4 * len(sampled)].view(-1, 4)
            top_p = None if all(reqs[i].params.top_p >= 1 for i in sampled) else x[:, 3]
            at = x[:, 0].long()
            tokens[at] = sample_rows(target_probs_rows(logits[at], x[:, 1], top_p), x[:, 2])
        if keyed:
            y = up[4 * len(sampled):].view(-1, 6)
            top_p = None if all(reqs[i].params.top_p >= 1 for i in keyed) else y[:, 2]
            at, ints = y[:, 0].long(), y[:, 3:].long()
            keys = position_keys(ints[:, 0], ints[:, 1], ints[:, 2])
            tokens[at] = keyed_argmax(logits[at], y[:, 1], top_p, keys, torch.arange(len(keyed), device=logits.device))
    return transfers.fetch(tokens).tolist()

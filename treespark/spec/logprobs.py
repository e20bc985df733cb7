"""Log-probabilities of emitted tokens under the target (OpenAI ``logprobs``).

Every token a request emits was chosen at one target position: the prefill's last
prompt position for the first token, and in a speculative round the root and each
accepted node, in order (the token emitted after accepted node ``path[j - 1]`` is read
from that node's logits; ``verify.VerifyResult``). Its log-probability is the
log-softmax of the target's raw logits there (before temperature and top-p, as vLLM
reports them by default), whatever the drafter proposed: speculation changes which
tokens are checked in one forward, not the distribution a token is read from, so the
numbers equal those of plain decoding.

``token_logprobs`` runs on the device over only the positions that emitted a token of a
request that asked, and brings back ``[tokens, 2 k + 1]`` numbers: the chosen token's
log-probability and the ``k`` most likely tokens with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespark.kernels import vocab

MAX_TOP_LOGPROBS = 20   # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float                         # log p_target(token | context), raw logits
    top: tuple[tuple[int, float], ...]     # the k most likely (token id, log-prob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [M, V] (the rows that emitted), tokens [M] (what they emitted) -> [M, 1 + 2k]:
    the chosen token's log-prob, then k log-probs and k token ids (as floats; exact below
    2**24) of the most likely tokens."""
    assert logits.dim() == 2 and tokens.shape == logits.shape[:1], (logits.shape, tokens.shape)
    assert 0 <= k <= MAX_TOP_LOGPROBS
    lp = torch.log_softmax(logits.float(), dim=-1)                # [M, V]
    chosen = lp.gather(1, tokens[:, None])                         # [M, 1]
    if k == 0:
        return chosen
    top = vocab.topk(lp, k)                                        # [M, k]
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def unpack(rows: list[list[float]], tokens: list[int], k: int) -> list[TokenLogprob]:
    """The host side of ``token_logprobs``: one ``TokenLogprob`` per emitted token."""
    assert len(rows) == len(tokens)
    return [TokenLogprob(t, r[0], tuple((int(i), v) for v, i in zip(r[1:1 + k], r[1 + k:1 + 2 * k], strict=True)))
            for r, t in zip(rows, tokens, strict=True)]


@dataclass(frozen=True)
class Emitted:
    """Where one request's tokens of a step were chosen: its row in the step's logits, the
    positions (node indices) in emission order, the tokens, and how many alternatives."""

    row: int
    positions: list[int]
    tokens: list[int]
    k: int


def step_logprobs(logits: torch.Tensor, emitted: list[Emitted], transfers) -> list[list[TokenLogprob]]:
    """logits [B, K, V] of one step -> each ``Emitted``'s ``TokenLogprob`` list, with one
    upload, one device call and one copy back (``transfers``: a
    ``treespark.kernels.transfer.HostTransfers``)."""
    if not emitted:
        return []
    where = transfers.upload([[e.row for e in emitted for _ in e.positions],
                              [p for e in emitted for p in e.positions],
                              [t for e in emitted for t in e.tokens]], torch.long)   # rows, nodes, tokens
    k = max(e.k for e in emitted)
    host = transfers.fetch(token_logprobs(logits[where[0], where[1]], where[2], k)).tolist()   # [M, 1 + 2k]
    out, at = [], 0
    for e in emitted:
        m = len(e.positions)
        rows_e = [[r[0], *r[1:1 + e.k], *r[1 + k:1 + k + e.k]] for r in host[at:at + m]]
        out.append(unpack(rows_e, e.tokens, e.k))
        at += m
    return out

"""How much a drafter's drafts are worth to serving, measured offline on answers.

Serving drafts from one place only: the last token the target emitted in its answer
(the *anchor*), with the committed conversation as context. So a drafter is judged on
the target's answers to held-out prompts, with anchors on answer positions only:

* **agreement by offset**: the share of (anchor, row k) pairs whose drafted argmax
  (Markov parent = the true previous token) is the target's argmax token;
* **first-token acceptance**: offset 1's agreement, what a 1-node chain accepts;
* **chain tau at T = 0, simulated exactly**: for a k-chain, rounds run as the engine
  runs them (the first answer token comes from prefill; a round drafts
  min(k, max_tokens - emitted - 1) tokens and accepts the longest prefix that matches
  the target's argmax, plus one bonus token), so tau = (accepted + rounds) / rounds
  is what ``treespark bench acceptance`` measures for ``Budget.chain(k)`` on the same
  greedy answers (up to argmax ties between a batched and a teacher-forced forward).

At T = 0 a drafted chain that has matched so far has the true tokens as parents, so
teacher-forced block predictions give the greedy walk exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from treespark.models.drafter import DSparkDrafter
from treespark.training.train import Features


@dataclass(frozen=True)
class Judgement:
    agreement: tuple[float, ...]   # [block] top-1 agreement with the target at offsets 1..block
    first_token: float             # agreement at offset 1
    chain_tau: tuple[float, ...]   # [block] simulated T = 0 tau of a k-chain, k = 1..block
    anchors: int                   # answer positions scored
    sequences: int
    max_tokens: int                # answer tokens per request in the chain simulation

    def as_dict(self) -> dict:
        d = asdict(self)
        d["agreement"] = [round(x, 4) for x in self.agreement]
        d["first_token"] = round(self.first_token, 4)
        d["chain_tau"] = [round(x, 4) for x in self.chain_tau]
        return d


@torch.no_grad()
def block_matches(drafter: DSparkDrafter, feats: Features, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every answer anchor p of sequence ``seq`` (p = answer_start .. n - 1), whether
    row k's argmax is the target's next token after p + k: ``match`` [A, block], and
    ``valid`` [A, block] (the true token after p + k exists in the sequence)."""
    sl = feats.sequence(seq)
    n, blk = sl.stop - sl.start, drafter.config.block_size
    dev = drafter.fc.weight.device
    tokens = feats.tokens[sl].to(dev)
    taps = feats.taps[sl].to(dev, drafter.fc.weight.dtype)
    labels = feats.labels[sl].to(dev)
    start = int(feats.answer_start[seq])
    # pad by a block so every anchor's rows exist; padded rows are never valid
    tokens = torch.cat([tokens, torch.full((blk,), drafter.config.mask_token_id, device=dev)])
    taps = torch.cat([taps, taps.new_zeros(blk, taps.shape[1])])
    labels = torch.cat([labels, labels.new_full((blk,), -1)])
    anchors = torch.arange(start, n, device=dev)                          # [A]
    logits = drafter.train_logits(taps, tokens, anchors)                  # [A, blk, Vd]
    guess = logits.argmax(-1)
    d2t = drafter.draft_to_target
    if d2t is not None:
        guess = d2t.to(dev)[guess]
    pos = anchors[:, None] + torch.arange(blk, device=dev)                # row k predicts after p + k
    valid = pos <= n - 2
    return (guess == labels[pos]) & valid, valid


def chain_rounds(match: torch.Tensor, k: int, max_tokens: int) -> tuple[int, int]:
    """(rounds, accepted draft tokens) of a k-chain at T = 0 over one greedy answer.

    match: [A, block] bool from ``block_matches`` (anchor i = the answer's i-th token).
    The answer's first token comes from prefill; a round from anchor i drafts
    min(k, max_tokens - emitted - 1) tokens and emits the matching prefix and a bonus
    token. Generation ends at the answer's end or after ``max_tokens`` tokens."""
    length = min(match.shape[0], max_tokens)      # tokens this request emits
    lead = torch.cumprod(match.int(), dim=1).sum(1).tolist()  # leading matches per anchor
    emitted, rounds, accepted = 1, 0, 0
    while emitted < length:
        depth = min(k, max_tokens - emitted - 1)
        m = min(lead[emitted - 1], depth)
        rounds += 1
        accepted += m
        emitted += m + 1
    return rounds, accepted


def judge(drafter: DSparkDrafter, feats: Features, *, max_tokens: int) -> Judgement:
    """Agreement by offset over every answer anchor of ``feats`` and the simulated T = 0
    chain tau for k = 1..block, each sequence a request of at most ``max_tokens``."""
    blk = drafter.config.block_size
    hits = torch.zeros(blk, dtype=torch.float64)
    counts = torch.zeros(blk, dtype=torch.float64)
    rounds = [0] * blk
    accepted = [0] * blk
    anchors = 0
    for seq in range(len(feats)):
        match, valid = block_matches(drafter, feats, seq)
        hits += match.double().sum(0).cpu()
        counts += valid.double().sum(0).cpu()
        anchors += int(valid[:, 0].sum())
        for k in range(1, blk + 1):
            r, a = chain_rounds(match.cpu(), k, max_tokens)
            rounds[k - 1] += r
            accepted[k - 1] += a
    agreement = tuple(float(x) for x in hits / counts.clamp(min=1))
    tau = tuple((a + r) / max(r, 1) for a, r in zip(accepted, rounds, strict=True))
    return Judgement(agreement, agreement[0], tau, anchors, len(feats), max_tokens)


def heldout_features(pair, *, n_prompts: int, max_tokens: int, batch_size: int = 16,
                     progress: bool = True) -> Features:
    """The target's greedy answers (at most ``max_tokens``) to the first ``n_prompts``
    held-out prompts, teacher-forced: what ``judge`` scores a drafter on."""
    from treespark.engine.run import target_answers
    from treespark.models.prompts import load_prompts, pair_prompts
    from treespark.training.train import target_features

    prompts = pair_prompts(pair, min(n_prompts, len(load_prompts("heldout"))))
    seqs = target_answers(pair, prompts, max_tokens, batch_size=batch_size, progress=progress)
    return target_features(pair.target, pair.drafter.config.target_layer_ids, seqs,
                           answer_starts=[len(p) for p in prompts], progress=progress)


def engine_chain_tau(pair, n_prompts: int, max_tokens: int, chains: tuple[int, ...]) -> dict[int, float]:
    """tau of ``Budget.chain(k)`` at T = 0 through the engine on the first ``n_prompts``
    held-out prompts: the rows ``treespark bench acceptance`` reports for chains."""
    from treespark.engine.run import run_engine
    from treespark.models.prompts import pair_prompts
    from treespark.spec.budget import Budget

    prompts = pair_prompts(pair, n_prompts)
    return {k: run_engine(pair, prompts, Budget.chain(k), max_tokens=max_tokens, batch_size=8).tau
            for k in chains}

"""Distillation of a DSpark drafter from its target.

Recipe (``TrainConfig``): run the target once over training sequences (teacher
forcing) and keep, per position, the tapped hidden states and the target's argmax
next token; then train the drafter to predict, for random anchors a in a sequence
and every block row k, the target's next token after position a + k, given the
context (positions < a), the anchor token and the Markov parent token at a + k.
The target's embedding and LM head are shared and frozen; the output vocabulary is
cut to the most frequent target labels (EAGLE-3 / FR-Spec style) so that drafting
stays cheap. Seeded, resumable, with progress shown.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from treespark.engine.kv import KVStore
from treespark.engine.target import TargetRunner
from treespark.models.checkpoint import save_drafter
from treespark.models.drafter import DSparkDrafter, attach_from_target
from treespark.models.drafter_config import DSparkConfig


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 100
    seqs_per_step: int = 4      # sequences per step, drawn without replacement (an epoch at a time)
    anchors_per_seq: int = 12   # distinct anchors per sequence, on its answer positions
    row_gamma: float = 0.0      # block row k (0-based) weighs exp(-k / row_gamma); 0: equal weights
    ce_weight: float = 1.0      # cross-entropy on the target's argmax token
    kl_weight: float = 0.0      # KL(p || q), p the target's top-K renormalised (as soft cross-entropy)
    tv_weight: float = 0.0      # total variation |p - q| / 2, p the target's top-K probabilities
    seed: int = 0
    log_every: int = 50
    save_every: int = 250

    def __post_init__(self) -> None:
        if self.seqs_per_step < 1 or self.anchors_per_seq < 1:
            raise ValueError("seqs_per_step and anchors_per_seq must be >= 1")
        if self.row_gamma < 0 or min(self.ce_weight, self.kl_weight, self.tv_weight) < 0:
            raise ValueError("row_gamma and the loss weights must be >= 0")
        if self.ce_weight + self.kl_weight + self.tv_weight <= 0:
            raise ValueError("at least one loss weight must be > 0")


@dataclass(frozen=True)
class Features:
    """Teacher-forced target features of training sequences (flattened).

    ``answer_start[i]`` is where sequence i's target answer begins: anchors (the token a
    block is drafted from) go on answer positions only, where serving drafts. The
    target's top-K next-token log-probabilities are the soft labels (K may be 0)."""

    tokens: torch.Tensor        # [N] token ids
    taps: torch.Tensor          # [N, n_taps * hidden] (float16 to save memory)
    labels: torch.Tensor        # [N] the target's argmax next token at each position
    starts: torch.Tensor        # [n_seq + 1] sequence boundaries
    answer_start: torch.Tensor  # [n_seq] first anchor position of each sequence (>= 1)
    top_ids: torch.Tensor       # [N, K] int32 the target's K likeliest next tokens
    top_logprobs: torch.Tensor  # [N, K] float16 their log-probabilities (full softmax)

    def save(self, path: Path) -> None:
        save_file({k: v.contiguous() for k, v in asdict(self).items()}, str(path))

    @classmethod
    def load(cls, path: Path) -> Features:
        return cls(**load_file(str(path)))

    def __len__(self) -> int:
        return int(self.starts.numel() - 1)


    def sequence(self, i: int) -> slice:
        return slice(int(self.starts[i]), int(self.starts[i + 1]))

    def head(self, n: int) -> Features:
        """The first ``n`` sequences."""
        end = int(self.starts[n])
        return Features(self.tokens[:end], self.taps[:end], self.labels[:end], self.starts[: n + 1],
                        self.answer_start[:n], self.top_ids[:end], self.top_logprobs[:end])


def concat_features(*parts: Features) -> Features:
    starts, offset = [torch.zeros(1, dtype=torch.long)], 0
    for f in parts:
        starts.append(f.starts[1:].long() + offset)
        offset += int(f.starts[-1])
    cat = lambda name: torch.cat([getattr(f, name) for f in parts])  # noqa: E731
    return Features(cat("tokens"), cat("taps"), cat("labels"), torch.cat(starts), cat("answer_start"),
                    cat("top_ids"), cat("top_logprobs"))


@torch.no_grad()
def target_features(target, tap_layers: tuple[int, ...], sequences: Iterable[list[int]],
                    *, answer_starts: Iterable[int] | None = None, top_k: int = 0,
                    progress: bool = True, total: int | None = None) -> Features:
    """Run the target over each sequence (one forward each) and keep taps, argmax labels
    and the top-``top_k`` next-token log-probabilities. ``answer_starts``: where each
    sequence's answer begins (default 1: anchors anywhere)."""
    runner = TargetRunner(target, tap_layers)
    toks, taps, labels, starts, top_ids, top_lp = [], [], [], [0], [], []
    bar = tqdm(total=total, desc="target features", unit="seq", disable=not progress)
    store = None
    for seq in sequences:
        s = len(seq)
        if store is None or store.k.shape[3] < s:
            store = KVStore(runner.store_shape, 1, max(s, 256), runner.device, runner.dtype)
        ids = torch.tensor([seq], device=runner.device)
        pos = torch.arange(s, device=runner.device)[None]
        mask = (pos[0][None, :] <= pos[0][:, None])[None, None]
        out = runner.forward(ids, pos, pos, store, slice(0, 1), mask)
        toks.append(ids[0].cpu())
        taps.append(out.taps[0].to(torch.float16).cpu())
        logits = out.logits[0].float()
        labels.append(logits.argmax(-1).cpu())
        top = logits.log_softmax(-1).topk(top_k, dim=-1)
        top_ids.append(top.indices.to(torch.int32).cpu())
        top_lp.append(top.values.to(torch.float16).cpu())
        starts.append(starts[-1] + s)
        bar.update(1)
    bar.close()
    n_seq = len(starts) - 1
    answer = torch.tensor(list(answer_starts) if answer_starts is not None else [1] * n_seq, dtype=torch.long)
    if answer.numel() != n_seq or bool((answer < 1).any()):
        raise ValueError("answer_starts: one position >= 1 per sequence")
    return Features(torch.cat(toks), torch.cat(taps), torch.cat(labels), torch.tensor(starts), answer,
                    torch.cat(top_ids), torch.cat(top_lp))


def draft_vocabulary(labels: torch.Tensor, size: int, vocab_size: int,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent target labels (each counted with its weight, if
    given; a label of -1, where no forward computed one, is not counted), sorted by
    token id (the d2t map)."""
    known = labels >= 0
    counts = torch.bincount(labels[known], weights=None if weights is None else weights[known],
                            minlength=vocab_size)
    return counts.topk(min(size, vocab_size)).indices.sort().values


def init_from_target(drafter: DSparkDrafter, target, layer: int | None = None) -> None:
    """Start the drafter's backbone layers from one of the target's layers (the last)."""
    src = target.model.layers[layer if layer is not None else -1]
    with torch.no_grad():
        for dst in drafter.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w = getattr(src.self_attn, name).weight
                getattr(dst.self_attn, name).weight.copy_(w)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)


def target_to_draft(drafter: DSparkDrafter) -> torch.Tensor | None:
    """[V] draft index of each target token (-1 outside the draft vocabulary)."""
    d2t = drafter.draft_to_target
    if d2t is None:
        return None
    t2d = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
    t2d[d2t.cpu()] = torch.arange(d2t.numel())
    return t2d


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def row_weights(block: int, gamma: float) -> torch.Tensor:
    """[block] loss weight of each block row, exp(-k / gamma), mean 1 (gamma 0: all 1).
    Every accepted draft token needs row 0 right, so early rows matter most."""
    k = torch.arange(block, dtype=torch.float32)
    w = torch.exp(-k / gamma) if gamma > 0 else torch.ones(block)
    return w / w.mean()


def soft_losses(logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                t2d: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy and total variation against the target's top-K, per row.

    logits: [..., Vd] the drafter's; top_ids / top_logprobs: [..., K] the target's K
    likeliest tokens and log-probabilities. Tokens outside the draft vocabulary get
    q = 0; the target's mass beyond its top K counts as 0 (K = 16 holds most of it).
    Returns (soft CE of q under p renormalised over the top-K in the draft vocabulary,
    TV(p, q) = (sum_topK |p - q| + 1 - sum_topK q) / 2), each [...]."""
    logq = logits.float().log_softmax(-1)
    ids = top_ids.long()
    if t2d is not None:
        ids = t2d.to(ids.device)[ids]                                   # -1 outside Vd
    inside = ids >= 0
    logq_k = torch.where(inside, logq.gather(-1, ids.clamp(min=0)), torch.zeros_like(logq[..., :1]))
    p = top_logprobs.float().exp() * inside                             # [..., K]
    p_norm = p / p.sum(-1, keepdim=True).clamp(min=1e-8)
    soft_ce = -(p_norm * logq_k).sum(-1)
    q_k = logq_k.exp() * inside
    outside_p = (top_logprobs.float().exp() * ~inside).sum(-1)
    tv = 0.5 * ((p - q_k).abs().sum(-1) + outside_p + (1 - q_k.sum(-1)).clamp(min=0))
    return soft_ce, tv


def block_loss(drafter: DSparkDrafter, feats: Features, seq: int, anchors: torch.Tensor,
               t2d: torch.Tensor | None, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted loss summed over ``anchors`` x block rows of sequence ``seq`` (divide
    by ``len(anchors) * block`` for the mean), and the per-row top-1 hits [block]."""
    sl = feats.sequence(seq)
    dev = drafter.fc.weight.device
    tokens = feats.tokens[sl].to(dev)
    taps = feats.taps[sl].to(dev, drafter.fc.weight.dtype)
    anchors = anchors.to(dev)
    logits = drafter.train_logits(taps, tokens, anchors)               # [nb, blk, Vd]
    blk = drafter.config.block_size
    pos = anchors[:, None] + torch.arange(blk, device=dev)            # row k predicts after a+k
    target = feats.labels[sl].to(dev)[pos]
    if t2d is not None:
        target = t2d.to(dev)[target]                                   # -1 where outside Vd
    per = torch.zeros(pos.shape, device=dev)
    if cfg.ce_weight:
        ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-1, reduction="none")
        per = per + cfg.ce_weight * ce.view(pos.shape)
    if cfg.kl_weight or cfg.tv_weight:
        top_ids = feats.top_ids[sl].to(dev)[pos]
        top_lp = feats.top_logprobs[sl].to(dev)[pos]
        if top_ids.shape[-1] == 0:
            raise ValueError("kl_weight / tv_weight need features with the target's top-K (top_k > 0)")
        soft_ce, tv = soft_losses(logits, top_ids, top_lp, t2d)
        per = per + cfg.kl_weight * soft_ce + cfg.tv_weight * tv
    loss = (per * row_weights(blk, cfg.row_gamma).to(dev)).sum()
    hits = (logits.argmax(-1) == target).float().sum(0)
    return loss, hits


def anchor_range(feats: Features, seq: int, block: int) -> tuple[int, int]:
    """[lo, hi): the anchors of sequence ``seq`` whose block rows all predict a token of
    the sequence (answer positions only)."""
    n = int(feats.starts[seq + 1] - feats.starts[seq])
    return max(1, int(feats.answer_start[seq])), n - block


class SequenceDraws:
    """Sequences without replacement (a fresh order every epoch; ``weights`` make a
    sequence likelier to come early in an epoch), then distinct anchors in each."""

    def __init__(self, feats: Features, block: int, weights: torch.Tensor | None, g: torch.Generator) -> None:
        self.feats, self.block, self.g = feats, block, g
        ranges = [anchor_range(feats, i, block) for i in range(len(feats))]
        ok = torch.tensor([hi > lo for lo, hi in ranges], dtype=torch.float64)
        self.weights = ok * (weights.double() if weights is not None else 1.0)
        if not bool((self.weights > 0).any()):
            raise ValueError(f"no training sequence has an answer longer than block_size + 1 = {block + 1}")
        self.ranges = ranges
        self.order: list[int] = []

    def next_sequences(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if not self.order:
                count = int((self.weights > 0).sum())
                self.order = torch.multinomial(self.weights, count, replacement=False, generator=self.g).tolist()
            out.append(self.order.pop(0))
        return out

    def anchors(self, seq: int, n: int) -> torch.Tensor:
        lo, hi = self.ranges[seq]
        return lo + torch.randperm(hi - lo, generator=self.g)[:n]


def train_drafter(
    drafter: DSparkDrafter,
    feats: Features,
    cfg: TrainConfig,
    out_dir: Path,
    *,
    target=None,
    weights: torch.Tensor | None = None,
    progress: bool = True,
) -> dict:
    """Train (or resume training) ``drafter`` on ``feats``; checkpoints into ``out_dir``.
    ``weights`` [n_seq] makes some sequences come earlier in each epoch (default: uniform)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    start = 0
    state_file = out_dir / "train_state.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        drafter.load_state_dict(load_file(str(out_dir / "model.safetensors")), strict=True)
        _load_optimizer(opt, g, out_dir)
        start = int(state["step"])
        if target is not None and drafter.config.shared_embeddings:
            attach_from_target(drafter, target)
    t2d = target_to_draft(drafter)
    blk = drafter.config.block_size
    draws = SequenceDraws(feats, blk, weights, g)
    # a resumed run continues the epoch it stopped in (the order is part of the state)
    draws.order = json.loads(state_file.read_text()).get("order", []) if state_file.exists() else []
    drafter.train()
    history = []
    bar = tqdm(range(start, cfg.steps), desc="train drafter", initial=start, total=cfg.steps,
               disable=not progress)
    ema_loss, ema_acc = None, None
    t0 = time.time()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        opt.zero_grad(set_to_none=True)
        total, hits, count = 0.0, torch.zeros(blk), 0
        for seq in draws.next_sequences(cfg.seqs_per_step):
            anchors = draws.anchors(seq, cfg.anchors_per_seq)
            loss, h = block_loss(drafter, feats, seq, anchors, t2d, cfg)
            loss.backward()      # summed: the step's gradient is the mean over every (anchor, row)
            total += loss.item()
            hits += h.detach().cpu()
            count += anchors.numel()
        for p in params:
            if p.grad is not None:
                p.grad /= count * blk
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        mean, acc = total / (count * blk), hits / count
        ema_loss = mean if ema_loss is None else 0.95 * ema_loss + 0.05 * mean
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            rec = {"step": step + 1, "loss": round(ema_loss, 4),
                   "acc": [round(float(x), 3) for x in ema_acc], "elapsed_s": round(time.time() - t0, 1)}
            history.append(rec)
            bar.set_postfix(loss=f"{ema_loss:.3f}", acc1=f"{float(ema_acc[0]):.2f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            _checkpoint(drafter, opt, g, step + 1, draws.order, out_dir)
    drafter.eval()
    return {"history": history}


def _checkpoint(drafter, opt, g, step, order: list[int], out_dir: Path) -> None:
    save_drafter(drafter, out_dir, dtype=torch.float32)  # resumed training continues from exact weights
    _save_optimizer(opt, g, out_dir)
    (out_dir / "train_state.json").write_text(json.dumps({"step": step, "order": order}) + "\n")


def _save_optimizer(opt, g: torch.Generator, out_dir: Path) -> None:
    """Optimizer and RNG state as safetensors + JSON (nothing here is ever unpickled)."""
    sd = opt.state_dict()
    tensors = {"rng": g.get_state()}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            tensors[f"state.{idx}.{name}"] = torch.as_tensor(value).contiguous()
    save_file(tensors, str(out_dir / "optimizer.safetensors"))
    (out_dir / "optimizer.json").write_text(json.dumps(sd["param_groups"]) + "\n")


def _load_optimizer(opt, g: torch.Generator, out_dir: Path) -> None:
    tensors = load_file(str(out_dir / "optimizer.safetensors"))
    g.set_state(tensors.pop("rng"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    groups = json.loads((out_dir / "optimizer.json").read_text())
    opt.load_state_dict({"state": state, "param_groups": groups})


def new_drafter_for(target, *, block_size: int, tap_layers: tuple[int, ...], markov_rank: int,
                    mask_token_id: int, d2t: torch.Tensor | None, num_layers: int = 1,
                    seed: int = 0) -> DSparkDrafter:
    """A fresh shared-embedding drafter shaped after ``target`` (Llama family)."""
    tc = target.config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    rope_theta = getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg = DSparkConfig(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=head_dim, block_size=block_size,
        target_layer_ids=tuple(tap_layers), mask_token_id=mask_token_id, markov_rank=markov_rank,
        rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope_theta),
        rope_scaling=scaling if scaling.get("rope_type", "default") != "default" else None,
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 40_960)),
        draft_vocab_size=int(d2t.numel()) if d2t is not None else 0, shared_embeddings=True,
    )
    drafter = DSparkDrafter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        drafter.fc.weight.copy_(torch.randn(drafter.fc.weight.shape, generator=g) / math.sqrt(cfg.context_size))
        drafter.markov_head.markov_w1.weight.copy_(torch.randn(drafter.markov_head.markov_w1.weight.shape, generator=g) * 0.02)
        drafter.markov_head.markov_w2.weight.zero_()
        if d2t is not None:
            drafter.set_draft_vocabulary(d2t)
    init_from_target(drafter, target)
    attach_from_target(drafter, target)
    return drafter

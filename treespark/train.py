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

from treespark.drafter import DSparkConfig, DSparkDrafter, attach_from_target, save_drafter
from treespark.kv import KVStore
from treespark.target import TargetRunner


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 100
    anchors_per_step: int = 48
    seq_len: int = 256
    seed: int = 0
    log_every: int = 50
    save_every: int = 250


@dataclass(frozen=True)
class Features:
    """Teacher-forced target features of training sequences (flattened)."""

    tokens: torch.Tensor    # [N] token ids
    taps: torch.Tensor      # [N, n_taps * hidden] (float16 to save memory)
    labels: torch.Tensor    # [N] the target's argmax next token at each position
    starts: torch.Tensor    # [n_seq + 1] sequence boundaries

    def save(self, path: Path) -> None:
        save_file({k: v.contiguous() for k, v in asdict(self).items()}, str(path))

    @classmethod
    def load(cls, path: Path) -> Features:
        return cls(**load_file(str(path)))

    def __len__(self) -> int:
        return int(self.starts.numel() - 1)


def concat_features(*parts: Features) -> Features:
    starts, offset = [torch.zeros(1, dtype=torch.long)], 0
    for f in parts:
        starts.append(f.starts[1:].long() + offset)
        offset += int(f.starts[-1])
    return Features(torch.cat([f.tokens for f in parts]), torch.cat([f.taps for f in parts]),
                    torch.cat([f.labels for f in parts]), torch.cat(starts))


@torch.no_grad()
def target_features(target, tap_layers: tuple[int, ...], sequences: Iterable[list[int]],
                    *, progress: bool = True, total: int | None = None) -> Features:
    """Run the target over each sequence (one forward each) and keep taps + labels."""
    runner = TargetRunner(target, tap_layers)
    toks, taps, labels, starts = [], [], [], [0]
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
        labels.append(out.logits[0].argmax(-1).cpu())
        starts.append(starts[-1] + s)
        bar.update(1)
    bar.close()
    return Features(torch.cat(toks), torch.cat(taps), torch.cat(labels), torch.tensor(starts))


def draft_vocabulary(labels: torch.Tensor, size: int, vocab_size: int,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent target labels (each counted with its weight, if
    given), sorted by token id (the d2t map)."""
    counts = torch.bincount(labels, weights=weights, minlength=vocab_size)
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
    if drafter.d2t is None:
        return None
    t2d = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long)
    t2d[drafter.d2t.cpu()] = torch.arange(drafter.d2t.numel())
    return t2d


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def block_loss(drafter: DSparkDrafter, feats: Features, seq: int, anchors: torch.Tensor,
               t2d: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the drafter's block predictions against the target's labels,
    and the per-row top-1 accuracy [block]."""
    a, b = int(feats.starts[seq]), int(feats.starts[seq + 1])
    dev = drafter.fc.weight.device
    tokens = feats.tokens[a:b].to(dev)
    taps = feats.taps[a:b].to(dev, drafter.fc.weight.dtype)
    labels = feats.labels[a:b].to(dev)
    logits = drafter.train_logits(taps, tokens, anchors.to(dev))       # [nb, blk, Vd]
    blk = drafter.config.block_size
    pos = anchors.to(dev)[:, None] + torch.arange(blk, device=dev)    # row k predicts after a+k
    target = labels[pos]
    if t2d is not None:
        target = t2d.to(dev)[target]                                   # -1 where outside Vd
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-1)
    acc = (logits.argmax(-1) == target).float().mean(0)
    return loss, acc


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
    ``weights`` [n_seq] makes some sequences likelier to be drawn (default: uniform)."""
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
    lengths = feats.starts[1:] - feats.starts[:-1]
    draw = (lengths > blk + 1).double()
    if weights is not None:
        draw = draw * weights.double()
    if not bool((draw > 0).any()):
        raise ValueError(f"no training sequence is longer than block_size + 1 = {blk + 1}")
    drafter.train()
    history = []
    bar = tqdm(range(start, cfg.steps), desc="train drafter", initial=start, total=cfg.steps,
               disable=not progress)
    ema_loss, ema_acc = None, None
    t0 = time.time()
    for step in bar:
        seq = int(torch.multinomial(draw, 1, generator=g))
        n = int(lengths[seq])
        anchors = torch.randint(1, n - blk + 1, (cfg.anchors_per_step,), generator=g)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        loss, acc = block_loss(drafter, feats, seq, anchors, t2d)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_acc = acc.detach() if ema_acc is None else 0.95 * ema_acc + 0.05 * acc.detach()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            rec = {"step": step + 1, "loss": round(ema_loss, 4),
                   "acc": [round(float(x), 3) for x in ema_acc], "elapsed_s": round(time.time() - t0, 1)}
            history.append(rec)
            bar.set_postfix(loss=f"{ema_loss:.3f}", acc1=f"{float(ema_acc[0]):.2f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            _checkpoint(drafter, opt, g, step + 1, out_dir)
    drafter.eval()
    return {"history": history}


def _checkpoint(drafter, opt, g, step, out_dir: Path) -> None:
    save_drafter(drafter, out_dir)
    _save_optimizer(opt, g, out_dir)
    (out_dir / "train_state.json").write_text(json.dumps({"step": step}) + "\n")


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


@torch.no_grad()
def evaluate(drafter: DSparkDrafter, feats: Features, *, anchors_per_seq: int = 32, seed: int = 0) -> list[float]:
    """Held-out top-1 agreement with the target per block row."""
    g = torch.Generator().manual_seed(seed)
    t2d = target_to_draft(drafter)
    blk = drafter.config.block_size
    accs = []
    for seq in range(len(feats)):
        n = int(feats.starts[seq + 1] - feats.starts[seq])
        if n <= blk + 1:
            continue
        anchors = torch.randint(1, n - blk + 1, (anchors_per_seq,), generator=g)
        _, acc = block_loss(drafter, feats, seq, anchors, t2d)
        accs.append(acc)
    return torch.stack(accs).mean(0).tolist()


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
            drafter.d2t.copy_(d2t)
    init_from_target(drafter, target)
    attach_from_target(drafter, target)
    return drafter

"""The target model's forward for speculative decoding, over a transformers model.

One call verifies a batch of draft trees: each row holds a request's tree (padded),
attends to its own committed KV and to its tree ancestors (a 4D mask), writes its
tree's keys/values into its KV row, and returns the logits at every tree node plus
the hidden states of the layers the drafter taps.

We run the transformers model's own weights and modules (embeddings, norms, rotary
embedding) through a small forward of our own instead of ``model(...)``: it writes
into our preallocated per-request KV rows, computes logits only where needed, and
multiplies on CPU in the layouts that run fastest there: at each row count the
fastest of ``F.linear``, ``treespark.kernels.linear`` and oneDNN-packed weights, as timed on
this machine when the first runner over a model is built (``product_plan``, a few
seconds for the default target, then read from a cache on disk; pass ``products`` to
fix it instead). Packed weights are made only where the plan uses them. They are
copies (``packed_weights``): they double the weight memory on CPU and are shared by
every runner over the same model while it lives (``generate`` builds an engine per
call). A runner takes them at construction, packed again if a weight changed in
place or was replaced since they were packed (each weight's tensor version and
storage are compared; a change made through ``weight.data`` bypasses the version
counter and is not seen). A change during a runner's life is seen by the next
runner, not by that one.

Supported: the Llama family (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with
q/k norms).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from treespark.engine.attend import store_attention
from treespark.engine.kv import KVStore, PagedRows, PagedStore, StoreShape
from treespark.kernels.attention import AttentionPath
from treespark.kernels.linear import (
    PACKED,
    PLAN_ROWS,
    PackedWeight,
    ProductPlan,
    can_pack,
    measure_plan,
    pack,
    plan_sample,
    planned_linear,
)
from treespark.kernels.machine import hardware_name, read_cached, write_cached


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


def product_layers(model: PreTrainedModel) -> list[torch.nn.Linear]:
    """Every linear of a Llama-family model's decoder layers, then its LM head: the
    weights one forward multiplies by."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    return linears + [model.get_output_embeddings()]


@dataclass(frozen=True)
class PackedWeights:
    """oneDNN-packed copies of a model's product weights, and the state they copy."""

    weights: dict[torch.nn.Module, PackedWeight]
    state: tuple[tuple[int, int, int], ...]  # each weight's storage and version, its bias's storage


_PACKED: weakref.WeakKeyDictionary[PreTrainedModel, PackedWeights] = weakref.WeakKeyDictionary()


def _weight_state(linears: list[torch.nn.Linear]) -> tuple[tuple[int, int, int], ...]:
    """What a packed copy is valid for. (A bias is not copied, so only its replacement
    matters.)"""
    return tuple((m.weight.data_ptr(), m.weight._version, 0 if m.bias is None else m.bias.data_ptr())
                 for m in linears)


def _packable(linears: list[torch.nn.Linear]) -> bool:
    return all(can_pack(m.weight) for m in linears)


def packed_weights(model: PreTrainedModel) -> PackedWeights | None:
    """The packed copies of ``model``'s product weights (None where ``can_pack`` is
    False for any of them): one set per model, packed again when a weight has changed
    in place or been replaced since it was packed."""
    linears = product_layers(model)
    if not _packable(linears):
        return None
    state = _weight_state(linears)
    cached = _PACKED.get(model)
    if cached is None or cached.state != state:
        cached = PackedWeights({m: pack(m.weight, m.bias) for m in linears}, state)
        _PACKED[model] = cached
    return cached


_PLANS: weakref.WeakKeyDictionary[PreTrainedModel, ProductPlan] = weakref.WeakKeyDictionary()


PLAN_CACHE_DIR = Path.home() / ".cache" / "treespark" / "product-plans"


def plan_key(weights: list[torch.Tensor], packable: bool) -> str:
    """What a plan is valid for, hashed: the machine, torch and its threads, and the
    shapes and dtype of the weights it times (not their values)."""
    key = {"hw": hardware_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": str(weights[0].dtype), "shapes": [list(w.shape) for w in weights], "packed": packable,
           "rows": list(PLAN_ROWS)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def product_plan(model: PreTrainedModel, cache_dir: Path | None = PLAN_CACHE_DIR) -> ProductPlan | None:
    """Which product layout a forward of ``model`` runs at each row count on this
    machine (``treespark.kernels.linear.measure_plan`` over a sample of its weights); None off
    CPU, where every product is ``F.linear``. Measured once per machine and model
    shape: kept for the model's life, and in ``cache_dir`` (None: not on disk) under
    ``plan_key``, so that every process on one machine multiplies alike (the
    measurement varies from run to run where two layouts are within noise) and the
    step-cost cache, whose key holds the plan, is found again."""
    if next(model.parameters()).device.type != "cpu":
        return None
    plan = _PLANS.get(model)
    if plan is not None:
        return plan
    linears = product_layers(model)
    per_layer = sum(isinstance(m, torch.nn.Linear) for m in model.model.layers[0].modules())
    idx = plan_sample([m.weight for m in linears], per_layer)
    packable = _packable(linears)
    path = None if cache_dir is None else Path(cache_dir) / f"{plan_key([linears[i].weight for i in idx], packable)}.json"
    cached = None if path is None else read_cached(path)
    try:
        plan = None if cached is None else ProductPlan(tuple(cached["rows"]), tuple(cached["layouts"]))
    except (ValueError, KeyError, TypeError):
        plan = None  # unreadable: measure again
    if plan is None:
        plan = _measure_plan(model, linears, idx)
        if path is not None:
            write_cached(path, {"rows": plan.rows, "layouts": plan.layouts, "describe": plan.describe()})
    _PLANS[model] = plan
    return plan


def _measure_plan(model: PreTrainedModel, linears: list[torch.nn.Linear], idx: list[int]) -> ProductPlan:
    packs = packed_weights(model)
    plan, _ = measure_plan([linears[i].weight.detach() for i in idx],
                           None if packs is None else [packs.weights[linears[i]] for i in idx])
    if PACKED not in plan.layouts:  # the copies would double the weights' memory for nothing
        _PACKED.pop(model, None)
    return plan


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [B, K, V] float32 ([B, 1, V] for "last"; None for "none")
    taps: torch.Tensor           # [B, K, n_taps * hidden] the tapped layers' outputs


class TargetRunner:
    """Runs a transformers causal LM (Llama family) against a ``KVStore``."""

    def __init__(self, model: PreTrainedModel, tap_layers: tuple[int, ...],
                 products: ProductPlan | None = None, attention: AttentionPath = AttentionPath.GROUPED) -> None:
        """``products``: the CPU product layout per row count (default: ``product_plan``,
        timed on this machine); ignored off CPU. ``attention``: the attention path
        (``treespark.kernels.attention``; the reference is the plain gather + SDPA)."""
        self.model = model
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise ValueError(f"{type(model).__name__} is not a Llama-family causal LM")
        self.base = base
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        for i in tap_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"tap layer {i} outside the target's {self.num_layers} layers")
        self.tap_layers = tuple(tap_layers)
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_heads = cfg.num_attention_heads
        self.attention = attention
        self.scaling = attn.scaling
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # on CPU: which layout each row count runs in (treespark.kernels.linear), and a copy of
        # every product weight in oneDNN's layout where the plan multiplies by one
        self.products: ProductPlan | None = None
        self._packed: dict[torch.nn.Module, PackedWeight] = {}
        if self.device.type == "cpu":
            self.products = products or product_plan(model)
            if PACKED in self.products.layouts:
                packs = packed_weights(model)
                if packs is None:
                    raise ValueError(f"product plan {self.products.describe()!r} needs packed weights, and this "
                                     f"{self.dtype} model has none (oneDNN: {torch.backends.mkldnn.is_available()})")
                self._packed = packs.weights

    @property
    def products_described(self) -> str | None:
        """The product plan in words (``ProductPlan.describe``); None off CPU."""
        return None if self.products is None else self.products.describe()

    @property
    def store_shape(self) -> StoreShape:
        return StoreShape(self.num_layers, self.num_kv_heads, self.head_dim)

    def _linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        """x: [N, in] -> [N, out] (row-major), in the plan's layout for N rows."""
        return planned_linear(x, layer.weight, layer.bias, self.products, self._packed.get(layer))

    def _attention(self, layer, x, cos, sin, store, idx, rows, write_pos, attend, b, k):
        attn = layer.self_attn
        q = self._linear(x, attn.q_proj).view(b, k, -1, self.head_dim)
        kk = self._linear(x, attn.k_proj).view(b, k, -1, self.head_dim)
        vv = self._linear(x, attn.v_proj).view(b, k, -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, kk = attn.q_norm(q), attn.k_norm(kk)
        q, kk, vv = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        kk = kk * cos + _rotate_half(kk) * sin
        store.write(idx, rows, write_pos, kk, vv)
        out = attend(idx, q)                                                 # [B, H, K, hd]
        return self._linear(out.transpose(1, 2).reshape(b * k, -1), attn.o_proj)

    def _mlp(self, mlp, x):
        return self._linear(mlp.act_fn(self._linear(x, mlp.gate_proj)) * self._linear(x, mlp.up_proj),
                            mlp.down_proj)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,      # [B, K] input ids
        positions: torch.Tensor,   # [B, K] position ids (a tree node's: root position + depth)
        write_pos: torch.Tensor,   # [B, K] where each token's keys/values go in its KV row
        store: KVStore | PagedStore,
        rows: slice | PagedRows,   # the batch's rows of a dense store, or its block tables' slots
        mask: torch.Tensor,        # [B, 1, K, T] bool: True = may attend (T >= every position + 1)
        logits_for: str | torch.Tensor = "all",  # "all" nodes, the "last" one of each row, "none",
                                                 # or [B] the index of each row's one token
    ) -> ForwardOutput:
        b, k = tokens.shape
        h = self.base.embed_tokens(tokens).to(self.dtype)                  # [B, K, h]
        cos, sin = self.base.rotary_emb(h, positions)
        cos, sin = cos[:, None].to(self.dtype), sin[:, None].to(self.dtype)
        x = h.reshape(b * k, -1)
        attend = store_attention(self.attention, store, rows, mask, groups=self.num_heads // self.num_kv_heads,
                                 dtype=self.dtype, scale=self.scaling)
        taps: dict[int, torch.Tensor] = {}
        for idx, layer in enumerate(self.base.layers):
            a = self._attention(layer, layer.input_layernorm(x), cos, sin, store, idx, rows,
                                write_pos, attend, b, k)
            x = x + a
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
            if idx in self.tap_layers:
                taps[idx] = x
        tapped = torch.cat([taps[i] for i in self.tap_layers], dim=-1).view(b, k, -1)
        if isinstance(logits_for, torch.Tensor):
            x = x.view(b, k, -1)[torch.arange(b, device=x.device), logits_for]
            k = 1
        elif logits_for == "none":
            return ForwardOutput(logits=None, taps=tapped)
        elif logits_for == "last":
            x = x.view(b, k, -1)[:, -1]
            k = 1
        else:
            assert logits_for == "all", f"logits_for must be all, last or none, not {logits_for!r}"
        x = self.base.norm(x)
        logits = self._linear(x, self.model.get_output_embeddings()).view(b, k, -1).float()
        return ForwardOutput(logits=logits, taps=tapped)

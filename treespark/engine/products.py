"""The matrix products of the target's forward: fused weights, packed copies, the plan.

A decoder layer of the Llama family multiplies by seven weights; the target's forward
(``treespark.engine.target``) multiplies by four, as vLLM does: q|k|v stacked into one
``[(Hq + 2 Hkv) D, hidden]`` weight (with the Qwen2 biases stacked alike), o, gate|up
stacked into one ``[2 I, hidden]`` weight, and down; then the LM head. One product over
a stacked weight gives the same values as the separate ones, to float rounding.

The stacked weights cost no memory: the first runner over a model concatenates each
layer's q, k, v (and gate, up) once and makes the model's own parameters views of the
stacked tensor (same names, values and ``requires_grad``; the model's own forward runs
on them unchanged), so the separate copies are freed. Later runners find the
parameters already in place and stack nothing. An in-place change to a parameter is
therefore a change to the stacked weight; a parameter replaced by another tensor is
stacked again (with its neighbours) by the next runner.

A model whose weights are bfloat16 values in float32 storage (``treespark.models.precision``)
also gets a bfloat16 copy of each weight (``half``), which the native kernel reads at half
the bytes to the same values: where the plan runs a row count on the copies, the float32
weights still serve the others (1.5x the weights' memory; the copies are dropped where
the plan does not use them).

On CPU every product runs in the layout a ``ProductPlan`` picks for its row count
(``treespark.kernels.linear``), measured over these products' shapes when the first
runner over a model is built (``product_plan``, a few seconds for the default target,
then read from a cache on disk). Packed weights are made only where the plan uses them.
They are copies: they double the weight memory on CPU and are shared by every runner
over the same model while it lives (``generate`` builds an engine per call). A runner
takes them at construction, packed again if a weight changed in place or was replaced
since they were packed (each weight's tensor version and storage are compared; a change
made through ``weight.data`` bypasses the version counter and is not seen). A change
during a runner's life is seen by the next runner, not by that one.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from treespark.kernels import native
from treespark.kernels.linear import (
    HALF,
    LAYOUTS,
    PACKED,
    PLAN_ROWS,
    PackedWeight,
    ProductPlan,
    can_pack,
    measure_plan,
    pack,
    plan_sample,
)
from treespark.kernels.machine import hardware_name, read_cached, write_cached
from treespark.models.linears import product_linears


@dataclass(frozen=True)
class Product:
    """One product of the forward, ``x @ weight.T + bias``; ``packed``: the weight in
    oneDNN's layout (with the bias), ``half``: its bfloat16 copy in panels
    (``native.to_panels``; a weight of bfloat16 values: exact), where the plan multiplies by one."""

    weight: torch.Tensor        # [out, in]
    bias: torch.Tensor | None   # [out]
    packed: PackedWeight | None = None
    half: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerProducts:
    """One decoder layer's products: one stacked product (``fused``) or the separate ones."""

    qkv: tuple[Product, ...]      # (q|k|v,) stacked, or (q, k, v)
    o: Product
    gate_up: tuple[Product, ...]  # (gate|up,) stacked, or (gate, up)
    down: Product

    def products(self) -> list[Product]:
        return [*self.qkv, self.o, *self.gate_up, self.down]


@dataclass(frozen=True)
class ModelProducts:
    """Every product of one forward of a model, and the state of the weights they hold."""

    layers: tuple[LayerProducts, ...]
    head: Product
    fused: bool
    state: tuple[tuple[int, ...], ...]  # each source weight's and bias's storage and version

    @property
    def packed(self) -> bool:
        return self.head.packed is not None

    @property
    def half(self) -> bool:
        return self.head.half is not None

    def products(self) -> list[Product]:
        """The layers' products in order, then the head's."""
        return [p for layer in self.layers for p in layer.products()] + [self.head]


def _state(linears: list[nn.Linear]) -> tuple[tuple[int, ...], ...]:
    def one(t: torch.Tensor | None) -> tuple[int, int]:
        return (0, 0) if t is None else (t.data_ptr(), t._version)

    return tuple((*one(m.weight), *one(m.bias)) for m in linears)


def _stacked_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor ``torch.cat(parts)`` would be, where ``parts`` already lie one after
    another in one storage (contiguous, same dtype); else None."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def _stack(mods: list[nn.Module], name: str) -> torch.Tensor | None:
    """``mods``' parameter ``name`` stacked along dim 0, the parameters made views of it
    (None where none of them has one)."""
    params = [getattr(m, name) for m in mods]
    if all(p is None for p in params):
        return None
    if any(p is None for p in params):
        raise ValueError(f"cannot stack {name}: some of the projections have one, some do not")
    stacked = _stacked_view([p.detach() for p in params])
    if stacked is not None:
        return stacked
    with torch.no_grad():
        stacked = torch.cat([p.detach() for p in params])
    start = 0
    for m, p in zip(mods, params, strict=True):
        n = p.shape[0]
        setattr(m, name, nn.Parameter(stacked[start:start + n], requires_grad=p.requires_grad))
        start += n
    return stacked


def _fused_product(mods: list[nn.Linear]) -> Product:
    return Product(_stack(mods, "weight"), _stack(mods, "bias"))


def _plain(m: nn.Linear) -> Product:
    return Product(m.weight.detach(), None if m.bias is None else m.bias.detach())


def _layer_products(layer: nn.Module, fused: bool) -> LayerProducts:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    if fused:
        return LayerProducts((_fused_product(qkv),), _plain(attn.o_proj), (_fused_product(gate_up),),
                             _plain(mlp.down_proj))
    return LayerProducts(tuple(map(_plain, qkv)), _plain(attn.o_proj), tuple(map(_plain, gate_up)),
                         _plain(mlp.down_proj))


def _with(products: ModelProducts, extra: Callable[[Product], Product]) -> ModelProducts:
    """``products`` with ``extra`` applied to each product (a packed or half copy added)."""
    layers = tuple(LayerProducts(tuple(map(extra, lp.qkv)), extra(lp.o), tuple(map(extra, lp.gate_up)),
                                 extra(lp.down)) for lp in products.layers)
    return replace(products, layers=layers, head=extra(products.head))


def _packed(p: Product) -> Product:
    return replace(p, packed=pack(p.weight, p.bias))


def _half(p: Product) -> Product:
    return replace(p, half=native.to_panels(p.weight))


_PRODUCTS: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[bool, bool, bool], ModelProducts]] = (
    weakref.WeakKeyDictionary())


def model_products(model: PreTrainedModel, fused: bool = True, packed: bool = False,
                   half: bool = False) -> ModelProducts:
    """``model``'s products (``fused``: q|k|v and gate|up stacked; ``packed``: with packed
    copies, ValueError where ``can_pack`` is False for a weight; ``half``: with bfloat16
    copies, ValueError unless ``halvable``): one set per model and kind, made again when a
    weight has changed in place or been replaced since."""
    linears = product_linears(model)
    if packed and not all(can_pack(m.weight) for m in linears):
        raise ValueError(f"cannot pack this {linears[0].weight.dtype} model's weights on "
                         f"{linears[0].weight.device.type} (oneDNN: {torch.backends.mkldnn.is_available()})")
    by_kind = _PRODUCTS.setdefault(model, {})
    cached = by_kind.get((fused, packed, half))
    if cached is not None and cached.state == _state(linears):
        return cached
    if half and not halvable(model):
        raise ValueError("bfloat16 copies need a float32 model whose weights are bfloat16 values "
                         "(treespark.models.precision.round_to_bf16)")
    layers = tuple(_layer_products(layer, fused) for layer in model.model.layers)  # may restack
    made = ModelProducts(layers, _plain(model.get_output_embeddings()), fused, _state(linears))
    if packed:
        made = _with(made, _packed)
    if half:
        made = _with(made, _half)
    by_kind[(fused, packed, half)] = made
    return made


def packable(model: PreTrainedModel) -> bool:
    """Whether ``model_products(model, packed=True)`` can pack every weight."""
    return all(can_pack(m.weight) for m in product_linears(model))


def halvable(model: PreTrainedModel) -> bool:
    """Whether every product weight of ``model`` is a float32 CPU matrix of bfloat16 values,
    so that a bfloat16 copy holds it exactly (``treespark.models.precision``), of a multiple
    of 16 rows (the copies are ``native.to_panels``')."""
    return all(native.is_bf16_valued(m.weight) and native.can_panel(m.weight) for m in product_linears(model))


def drop_copies(model: PreTrainedModel, packed: bool, half: bool) -> None:
    """Forget ``model``'s packed (``packed``) or half (``half``) copies: their memory goes
    with the last runner holding them."""
    for kind in [k for k in _PRODUCTS.get(model, {}) if (packed and k[1]) or (half and k[2])]:
        del _PRODUCTS[model][kind]


_PLANS: weakref.WeakKeyDictionary[PreTrainedModel, ProductPlan] = weakref.WeakKeyDictionary()


PLAN_CACHE_DIR = Path.home() / ".cache" / "treespark" / "product-plans"
PLAN_RULE = 3  # how ``choose_plan`` decides from the timings (in the key: a new rule times again)


def plan_key(weights: list[torch.Tensor], packable: bool, half: bool = False) -> str:
    """What a plan is valid for, hashed: the machine, torch and its threads, the rule that
    chooses (``PLAN_RULE``), the layouts it chooses from (``half``: bfloat16 copies among
    them; the native kernels' build, which names their sources), and the shapes and dtype
    of the weights it times (not their values)."""
    key = {"hw": hardware_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": str(weights[0].dtype), "shapes": [list(w.shape) for w in weights], "packed": packable,
           "rows": list(PLAN_ROWS), "layouts": list(LAYOUTS),
           "native": None if native.build_id() is None else [native.MAX_ROWS, native.build_id()],
           "half": half, "rule": PLAN_RULE}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def product_plan(model: PreTrainedModel, cache_dir: Path | None = PLAN_CACHE_DIR) -> ProductPlan | None:
    """Which product layout a forward of ``model`` runs at each row count on this
    machine (``treespark.kernels.linear.measure_plan`` over a sample of its fused
    products); None off CPU, where every product is ``F.linear``. Measured once per
    machine and model shape: kept for the model's life, and in ``cache_dir`` (None: not
    on disk) under ``plan_key``, so that every process on one machine multiplies alike
    (the measurement varies from run to run where two layouts are within noise) and the
    step-cost cache, whose key holds the plan, is found again."""
    if next(model.parameters()).device.type != "cpu":
        return None
    plan = _PLANS.get(model)
    if plan is not None:
        return plan
    products = model_products(model).products()
    idx = plan_sample([p.weight for p in products], len(model_products(model).layers[0].products()))
    can, half = packable(model), halvable(model)
    path = None if cache_dir is None else \
        Path(cache_dir) / f"{plan_key([products[i].weight for i in idx], can, half)}.json"
    cached = None if path is None else read_cached(path)
    try:
        plan = None if cached is None else ProductPlan(tuple(cached["rows"]), tuple(cached["layouts"]))
    except (ValueError, KeyError, TypeError):
        plan = None  # unreadable: measure again
    if plan is None:
        plan = _measure_plan(model, idx, can, half)
        if path is not None:
            write_cached(path, {"rows": plan.rows, "layouts": plan.layouts, "describe": plan.describe()})
    _PLANS[model] = plan
    return plan


def _measure_plan(model: PreTrainedModel, idx: list[int], can: bool, half: bool) -> ProductPlan:
    products = model_products(model, packed=can, half=half).products()
    plan, _ = measure_plan([products[i].weight for i in idx],
                           [products[i].packed for i in idx] if can else None,
                           halves=[products[i].half for i in idx] if half else None)
    # copies the plan does not use would add to the weights' memory for nothing
    drop_copies(model, packed=PACKED not in plan.layouts, half=HALF not in plan.layouts)
    return plan

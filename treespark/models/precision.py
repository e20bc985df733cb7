"""A target's weight precision: float32 as the checkpoint holds it, or bfloat16 values.

On a CPU decoding reads every weight once a step, so the bytes a weight takes set the
step's time (`treespark bench linear`). ``round_to_bf16`` rounds each weight of the
target's products (the decoder layers' linears and the LM head, and with it a tied input
embedding) to the nearest bfloat16, in place, keeping float32 storage. The model is then
a bfloat16-weight model computed in float32: every product gives the same values whether
it reads the float32 weight or an exact bfloat16 copy of it at half the bytes
(``treespark.engine.products``, the ``HALF`` layout), so the product plan may read
whichever is faster at each row count without changing what the model computes.

Speculative decoding stays lossless: the drafts are verified against this model, which is
the target (plain decoding runs it too). It is not the float32 checkpoint: greedy text can
part from the checkpoint's where two tokens' logits are within bfloat16 rounding of each
other, as a bfloat16 GPU deployment's does.
"""

from __future__ import annotations

import torch
from torch import nn

from treespark.models.linears import product_linears

FLOAT32, BF16 = "float32", "bfloat16"
PRECISIONS = (FLOAT32, BF16)


def product_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights of ``model``'s products (``product_linears``), each tensor once, in order."""
    seen, out = set(), []
    for w in (m.weight for m in product_linears(model)):
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def round_to_bf16(model: nn.Module) -> int:
    """Round ``model``'s product weights (``product_weights``) to the nearest bfloat16
    value (ties to even), in place, in float32 storage; returns how many tensors it
    rounded (bfloat16 weights, as on a GPU, already are: left as they are). A model
    already rounded is unchanged. ValueError for other dtypes."""
    weights = [w for w in product_weights(model) if w.dtype != torch.bfloat16]
    for w in weights:
        if w.dtype != torch.float32:
            raise ValueError(f"round_to_bf16 rounds float32 weights, not {w.dtype}")
    with torch.no_grad():
        for w in weights:
            w.copy_(w.to(torch.bfloat16).to(torch.float32))
    return len(weights)


def set_precision(model: nn.Module, precision: str) -> None:
    """``model``'s weights at ``precision`` (one of ``PRECISIONS``): float32 leaves them as
    loaded; bfloat16 rounds them (``round_to_bf16``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if precision == BF16:
        round_to_bf16(model)

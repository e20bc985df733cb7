"""The linears a Llama-family causal LM's forward multiplies by: every ``nn.Linear`` of its
decoder layers, then its LM head. What the target's products are made of
(``treespark.engine.products``) and what a weight precision rounds
(``treespark.models.precision``)."""

from __future__ import annotations

from torch import nn


def product_linears(model: nn.Module) -> list[nn.Linear]:
    """Every linear of ``model.model.layers``, in order, then ``get_output_embeddings()``."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, nn.Linear)]
    return linears + [model.get_output_embeddings()]

"""TreeSpark: speculative decoding on calibrated, load-adaptive draft trees.

Public API (a contract that outside checks call):

* ``random_pair(vocab_size, seed, block_size=4) -> ModelPair``
* ``load_pair() -> ModelPair`` (the embedded default pair)
* ``Budget(theta, node_cap, branch_cap)``, ``Budget.chain(k)``, ``Budget.off()``
* ``generate(pair, prompt_ids, *, max_new_tokens, temperature=0.0, seed=None, budget=None) -> Generation``

The names resolve on first use (PEP 562), so ``import treespark.spec.budget`` or
``import treespark.pricing`` loads no torch: the serving control plane (controller,
HTTP ingress) imports the library without the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "Budget": "treespark.spec.budget",
    "Calibration": "treespark.spec.calibration",
    "Generation": "treespark.engine.run",
    "generate": "treespark.engine.run",
    "ModelPair": "treespark.models.pair",
    "load_pair": "treespark.models.pair",
    "random_pair": "treespark.models.pair",
}

__all__ = ["Budget", "Calibration", "Generation", "ModelPair", "generate", "load_pair", "random_pair"]

if TYPE_CHECKING:
    from treespark.engine.run import Generation, generate
    from treespark.models.pair import ModelPair, load_pair, random_pair
    from treespark.spec.budget import Budget
    from treespark.spec.calibration import Calibration


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'treespark' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))

"""TreeSpark: speculative decoding on calibrated, load-adaptive draft trees.

Public API (a contract that outside checks call):

* ``random_pair(vocab_size, seed, block_size=4) -> ModelPair``
* ``load_pair() -> ModelPair`` (the embedded default pair)
* ``Budget(theta, node_cap, branch_cap)``, ``Budget.chain(k)``, ``Budget.off()``
* ``generate(pair, prompt_ids, *, max_new_tokens, temperature=0.0, seed=None, budget=None) -> Generation``
"""

from treespark.budget import Budget
from treespark.calibration import Calibration
from treespark.decode import Generation, generate
from treespark.models import ModelPair, load_pair, random_pair

__all__ = ["Budget", "Calibration", "Generation", "ModelPair", "generate", "load_pair", "random_pair"]

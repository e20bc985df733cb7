"""The speculation budget: how much draft tree one request may verify per round.

A ``Budget`` is the whole interface between the serving policy and the tree
expander (TreeSpark, see docs/architecture.md):

* ``theta``      the price of one verified node: expansion stops as soon as the best
                 frontier candidate's calibrated path survival falls below it;
* ``node_cap``   the most draft nodes (the root excluded) one tree may hold;
* ``branch_cap`` the most children one node may have.

A chain is ``branch_cap = 1``; plain decoding is ``node_cap = 0`` (an empty tree).
Both are ordinary budgets, so there is one decoding path for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The most children one node may have unless told otherwise: the library's adaptive tree,
# the pricing policies and the served config all start from it. At a low price the
# wider candidate set buys tokens (theta 0.003, T = 0, tuning prompts: tau 2.414 with 4,
# 2.498 with 6 or 8), and at the default price the cap hardly binds (docs/findings.md).
DEFAULT_BRANCH_CAP = 8


@dataclass(frozen=True)
class Budget:
    theta: float
    node_cap: int
    branch_cap: int

    def __post_init__(self) -> None:
        if not isinstance(self.theta, (int, float)) or math.isnan(self.theta) or self.theta < 0:
            raise ValueError(f"Budget.theta must be a number >= 0, got {self.theta!r}")
        if not isinstance(self.node_cap, int) or self.node_cap < 0:
            raise ValueError(f"Budget.node_cap must be an integer >= 0, got {self.node_cap!r}")
        if not isinstance(self.branch_cap, int) or self.branch_cap < 1:
            raise ValueError(f"Budget.branch_cap must be an integer >= 1, got {self.branch_cap!r}")

    @classmethod
    def chain(cls, k: int) -> Budget:
        """A fixed chain of (up to) ``k`` draft tokens, the classic speculative decoding."""
        return cls(theta=0.0, node_cap=k, branch_cap=1)

    @classmethod
    def off(cls) -> Budget:
        """No speculation: every round verifies the root alone (plain decoding)."""
        return cls(theta=0.0, node_cap=0, branch_cap=1)

    @classmethod
    def adaptive(cls, theta: float = 0.08, node_cap: int = 32, branch_cap: int = DEFAULT_BRANCH_CAP) -> Budget:
        """The default adaptive tree: best-first under calibrated survival, stopped by theta.

        The default price (0.08) is the fastest at batch 1 for the default pair on a
        2-core CPU (chosen on the tuning prompts, docs/benchmarks/engine.md); where a verify
        forward is cheaper (a GPU at light load) a lower theta buys more tokens per
        forward. The serving policy sets theta from a measured cost model instead."""
        return cls(theta=theta, node_cap=node_cap, branch_cap=branch_cap)

    @property
    def is_off(self) -> bool:
        return self.node_cap == 0 or self.theta >= 1.0

    def to_wire(self) -> dict[str, float | int]:
        """The one wire form of a budget (controller replies, replica reports, configs,
        the override body): ``{"theta", "node_cap", "branch_cap"}``."""
        return {"theta": self.theta, "node_cap": self.node_cap, "branch_cap": self.branch_cap}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Budget:
        """The budget of ``to_wire``'s form (JSON numbers: an integral float is a cap)."""
        return cls(theta=float(d["theta"]), node_cap=int(d["node_cap"]), branch_cap=int(d["branch_cap"]))

    @property
    def kind(self) -> str:
        """A label for reports: 'off', 'chain' or 'tree'."""
        if self.is_off:
            return "off"
        return "chain" if self.branch_cap == 1 else "tree"

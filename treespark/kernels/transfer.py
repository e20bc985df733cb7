"""Device-to-host copies, counted: a decoding step's syncs and the numbers it moves.

Every value the engine reads back from the device during a step goes through
``HostTransfers.fetch``: one call is one host sync. The engine reports both counts
per step (``StepStats.host_syncs``, ``host_elements``), and tests hold them to the
stated bound and check that they do not grow with the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HostTransfers:
    syncs: int = 0
    elements: int = 0

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host (one sync when it lives on an accelerator)."""
        self.syncs += 1
        self.elements += t.numel()
        return t.to("cpu")

    def reset(self) -> tuple[int, int]:
        """The counts so far, then zero."""
        counts = (self.syncs, self.elements)
        self.syncs = self.elements = 0
        return counts

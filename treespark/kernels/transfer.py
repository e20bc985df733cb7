"""Every copy between the host and the device in a decoding step, counted.

Host to device (``HostTransfers.upload``): a step's inputs (token ids, positions,
tree shapes, uniforms) are built on the host as small arrays and go through here.
On CUDA each upload is written into a pinned staging buffer and copied with
``non_blocking=True``, so it never waits for the device; the buffer is one per step,
two of them taking turns (a step reuses the buffer of the step before last, whose
copies its own device-to-host copies have already waited for). On CPU an upload is
the array itself, no copy.

Device to host (``HostTransfers.fetch``): one call is one host sync. The engine
reports the counts per step (``StepStats.host_syncs``, ``host_elements``,
``host_uploads``), and tests hold them to the documented bound, check that they do
not grow with the vocabulary, and that no other line of a step copies a tensor
between host and device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_ALIGN = 64  # bytes: each upload starts on its own cache line of the staging buffer


@dataclass
class _Staging:
    """A pinned host buffer and the event that says its last copies are done."""

    buffer: torch.Tensor           # uint8, pinned
    used: int = 0
    done: torch.cuda.Event | None = None


@dataclass
class HostTransfers:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    syncs: int = 0       # device-to-host copies (each a host sync on an accelerator)
    elements: int = 0    # numbers those copies brought back
    uploads: int = 0     # host-to-device copies (non-blocking on CUDA)
    uploaded: int = 0    # numbers those copies carried
    _staging: list[_Staging] = field(default_factory=list)
    _turn: int = 0

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host (one sync when it lives on an accelerator)."""
        self.syncs += 1
        self.elements += t.numel()
        return t.to("cpu")

    def upload(self, values, dtype: torch.dtype) -> torch.Tensor:
        """``values`` (a list, a numpy array or a CPU tensor) as a ``dtype`` tensor on the
        device: one non-blocking copy on CUDA, none on CPU."""
        host = torch.as_tensor(np.asarray(values) if isinstance(values, list) else values, dtype=dtype)
        self.uploads += 1
        self.uploaded += host.numel()
        if self.device.type != "cuda":
            return host
        return self._stage(host).to(self.device, non_blocking=True)

    def _stage(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` copied into this step's pinned buffer (grown when it is too small)."""
        if not self._staging:
            self._staging = [_Staging(torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)) for _ in range(2)]
        s = self._staging[self._turn]
        nbytes = host.numel() * host.element_size()
        start = -(-s.used // _ALIGN) * _ALIGN
        if start + nbytes > s.buffer.numel():
            # a bigger buffer (torch's pinned allocator keeps the old one until its copies are done)
            size = max(2 * s.buffer.numel(), 2 * (start + nbytes))
            s.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            start = 0
        view = s.buffer[start:start + nbytes].view(host.dtype).view(host.shape)
        view.copy_(host)
        s.used = start + nbytes
        return view

    def counts(self) -> tuple[int, int, int, int]:
        """(syncs, elements fetched, uploads, elements uploaded) since the step began."""
        return self.syncs, self.elements, self.uploads, self.uploaded

    def new_step(self) -> None:
        """Zero the counts; uploads go to the other staging buffer from now on, once the
        copies out of it are done (they were queued a step ago, before that step's
        fetches, so this does not wait)."""
        self.syncs = self.elements = self.uploads = self.uploaded = 0
        if self._staging:
            s = self._staging[self._turn]
            s.done = torch.cuda.Event()
            s.done.record()
            self._turn = 1 - self._turn
            nxt = self._staging[self._turn]
            if nxt.done is not None:
                nxt.done.synchronize()
            nxt.used = 0

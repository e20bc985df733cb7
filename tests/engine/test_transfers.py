"""Every copy between host and device in a step goes through ``treespark.kernels.transfer``.

On CUDA, ``torch.tensor(..., device=cuda)`` and a CPU tensor's ``.to(cuda)`` are
blocking copies, and ``.cpu()`` / ``.to("cpu")`` a sync. On CPU none of them costs
anything, so this test watches the calls themselves: during every step of a mixed
batch (greedy, walked and reproducible sampled rows, top-p, logprobs, captured taps,
requests joining and finishing), each call that makes or moves a tensor from host data must come from the
transfer module, and the engine's own counts must equal what was watched."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from treespark import Budget, random_pair
from treespark.engine.config import EngineConfig
from treespark.engine.core import Engine
from treespark.spec.params import SamplingParams

TRANSFER = str(Path("treespark") / "kernels" / "transfer.py")


class Watch:
    """Patches the calls that copy between host and device; records each call site
    outside the transfer module, and counts the module's own uploads and fetches."""

    def __init__(self, resident=()):
        self.resident = {id(t) for t in resident}  # the models' weights and buffers: on the device already
        self.outside: list[str] = []
        self.uploads = self.fetches = 0

    def _site(self, kind: str) -> None:
        frame = sys._getframe(2)
        f = frame
        while f is not None:
            if f.f_code.co_filename.endswith(TRANSFER):
                if kind == "to host":
                    self.fetches += 1
                elif f.f_code.co_name == "upload" and f is frame:
                    self.uploads += 1
                return
            f = f.f_back
        self.outside.append(f"{kind} at {frame.f_code.co_filename}:{frame.f_lineno}")

    def __enter__(self):
        self.saved = torch.tensor, torch.as_tensor, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda
        tensor, as_tensor, to, cpu, cuda = self.saved
        watch = self

        def w_tensor(*a, **k):
            watch._site("torch.tensor")
            return tensor(*a, **k)

        def w_as_tensor(*a, **k):
            watch._site("torch.as_tensor")
            return as_tensor(*a, **k)

        def w_to(t, *a, **k):
            dev = k.get("device", a[0] if a and isinstance(a[0], (str, torch.device)) else None)
            if dev is not None and id(t) not in watch.resident:
                watch._site("to host" if torch.device(dev).type == "cpu" else "to device")
            return to(t, *a, **k)

        def w_cpu(t, *a, **k):
            watch._site("to host")
            return cpu(t, *a, **k)

        def w_cuda(t, *a, **k):
            watch._site("to device")
            return cuda(t, *a, **k)

        torch.tensor, torch.as_tensor = w_tensor, w_as_tensor
        torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda = w_to, w_cpu, w_cuda
        return self

    def __exit__(self, *exc):
        torch.tensor, torch.as_tensor, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda = self.saved


def test_every_host_device_copy_of_a_step_goes_through_the_transfer_module():
    pair = random_pair(256, 0, block_size=4, markov_rank=8, family="qwen3")
    engine = Engine(pair, EngineConfig(max_batch_size=5, max_context=96), budget=Budget(0.0, 8, 3))
    stats = []
    engine.on_step = stats.append
    params = [SamplingParams(max_tokens=10), SamplingParams(temperature=1.0, max_tokens=14, seed=1),
              SamplingParams(temperature=0.7, top_p=0.8, max_tokens=9, seed=2, logprobs=2),
              SamplingParams(max_tokens=12, logprobs=1),
              SamplingParams(temperature=0.9, top_p=0.9, max_tokens=11, seed=3, reproducible=True)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [3 + i, 1, 4, 1, 5], p, capture_taps=i == 1)
    resident = [*pair.target.parameters(), *pair.target.buffers(), *pair.drafter.parameters(),
                *pair.drafter.buffers()]
    watched, steps = [], 0
    while engine.has_unfinished():
        with Watch(resident) as w:
            engine.step()
        watched.append(w)
        steps += 1
        assert not w.outside, w.outside
    decode = [s for s in stats if s.draft_waves > 0]
    assert decode and any(s.batch_size >= 4 for s in decode)
    # the engine's counts are the watched ones (a step's stats cover its decode part and its prefill)
    assert sum(s.host_uploads for s in stats) <= sum(w.uploads for w in watched)
    assert sum(s.host_syncs for s in stats) <= sum(w.fetches for w in watched)
    for s in stats:
        # one per wave, verification, the logprobs asked; a prefill's first token and its
        # logprobs; a finished request's captured taps (``treespark.engine.core``)
        assert s.host_syncs <= s.draft_waves + 5, s
        # decode: the backbone, one per wave, two for the trees, two for the walk, one for the
        # reproducible rows, the commit, the logprobs; a prefill: its tokens, the sampled
        # first tokens, their logprobs
        assert s.host_uploads <= s.draft_waves + 11, s


def test_the_watch_sees_a_copy_made_elsewhere(monkeypatch):
    """The watch itself: a stray ``torch.tensor(..., device=)`` in a step is reported."""
    pair = random_pair(64, 0, block_size=3)
    engine = Engine(pair, EngineConfig(max_batch_size=2, max_context=48), budget=Budget(0.0, 4, 2))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    real = engine.sched.reserve_trees

    def stray():
        torch.tensor([1, 2], device=engine.device)
        return real()

    monkeypatch.setattr(engine.sched, "reserve_trees", stray)
    outside = []
    resident = [*pair.target.buffers(), *pair.drafter.buffers()]
    while engine.has_unfinished():
        with Watch(resident) as w:
            engine.step()
        outside += w.outside
    assert outside and all("test_transfers.py" in o for o in outside)

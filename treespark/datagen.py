"""Target-written training conversations for the drafter, as compact resumable shards.

A drafter learns what the target says in the contexts serving sees: chat requests
and the target's answers to them. This module has the target write that material
through the engine (plain decoding, ``Budget.off()``, batched), from many distinct
requests:

* **self-written**: the target, sampled with a per-request seed, writes a question or
  request a user might send about a subject (subjects from ``SUBJECTS`` and words of
  the offline corpus); that exchange is kept too, and the question is then answered;
* **from offline text**: stdlib docstrings and reference topics (``treespark.corpus``)
  to explain or summarise, docstring first sentences turned into "write a function
  to ..." tasks, and small stdlib functions (their source) to explain, test or review;
* **multi-turn**: a follow-up user turn after the target's first answer, answered again.

Answers are greedy or sampled (T in ``GenConfig.temperatures``). Repetition loops are
cut (``cut_repetition``) and empty or degenerate answers dropped. Heldout and tuning
prompts are never used (checked on every shard). Chat formatting is
``treespark.chat.chat_ids``.

Terms: a *sample* is one stored sequence, a formatted conversation followed by one
target answer; its ``answer_start`` is the index where that answer begins (anchors go
on answer positions only). A *shard* holds the samples of ``GenConfig.conversations``
first-turn requests and is a deterministic function of (config, sources, shard index)
on given hardware; shards are written atomically, so a run can be killed at any moment
and resumed (here or on another machine) from the committed shards.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import re
import sys
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from treespark.budget import Budget
from treespark.chat import chat_ids
from treespark.models import ModelPair
from treespark.params import SamplingParams
from treespark.prompts import load_prompts, tuning_prompts

SHARD_RE = re.compile(r"^shard-(\d{5})\.npz$")

# sample kinds, stored per sequence
KIND_WRITE_QUESTION = 0  # "write a question about X" -> the target's question
KIND_SELF = 1            # a target-written question -> its answer
KIND_DOC = 2             # a request built from documentation text -> its answer
KIND_CODE = 3            # a request about a stdlib function's source -> its answer
KIND_FOLLOWUP = 4        # first turn, answer, follow-up -> the second answer


@dataclass(frozen=True)
class GenConfig:
    version: str = "answers-1"
    conversations: int = 192                 # first-turn requests per shard (~7 min on 1 CPU thread)
    batch_size: int = 32                     # engine rows decoded together
    max_answer_tokens: int = 256
    max_question_tokens: int = 48            # for the target-written questions
    max_prompt_tokens: int = 384             # longer first-turn prompts are skipped
    max_context: int = 768                   # engine context: follow-ups must fit with an answer
    max_snippet_chars: int = 1200            # documentation / code pasted into a request
    mix: tuple[float, float, float] = (0.45, 0.35, 0.20)  # self-written, documentation, code
    greedy_fraction: float = 0.4             # the rest is sampled at one of ``temperatures``
    temperatures: tuple[float, ...] = (0.7, 0.8, 0.9, 1.0)
    question_temperature: float = 0.9
    subject_fraction: float = 0.6            # questions on SUBJECTS; the rest on corpus nouns
    followup_fraction: float = 0.35          # of usable first answers
    ngram: int = 8                           # repetition cut: an n-gram of this length ...
    ngram_repeats: int = 3                   # ... occurring this many times (non-overlapping)
    min_answer_tokens: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations <= 0 or self.batch_size <= 0:
            raise ValueError("conversations and batch_size must be > 0")
        if len(self.mix) != 3 or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError("mix must be three non-negative weights")
        if self.max_prompt_tokens + self.max_answer_tokens > self.max_context:
            raise ValueError("max_prompt_tokens + max_answer_tokens must fit in max_context")
        if not 0 <= self.greedy_fraction <= 1 or not 0 <= self.followup_fraction <= 1:
            raise ValueError("fractions must be in [0, 1]")
        if self.min_answer_tokens < 1:
            raise ValueError("min_answer_tokens must be >= 1")
        if self.ngram < 1 or self.ngram_repeats < 2:
            raise ValueError("ngram must be >= 1 and ngram_repeats >= 2")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Sources:
    """The offline material requests are built from."""

    subjects: tuple[str, ...]   # what target-written questions are about (a written list)
    words: tuple[str, ...]      # more subjects: nouns of the offline corpus
    docs: tuple[str, ...]       # documentation pieces (prose, some code)
    snippets: tuple[str, ...]   # Python source of small functions

    def __post_init__(self) -> None:
        if not (self.subjects and self.words and self.docs and self.snippets):
            raise ValueError("Sources needs subjects, words, docs and snippets")

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.subjects, self.words, self.docs, self.snippets):
            h.update("\0".join(part).encode())
            h.update(b"\1")
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class Sample:
    tokens: list[int]     # conversation + answer
    answer_start: int     # tokens[answer_start:] is the target's answer
    kind: int
    temperature: float

    def __post_init__(self) -> None:
        if not 0 < self.answer_start < len(self.tokens):
            raise ValueError("a sample needs a non-empty context and a non-empty answer")


# -- the request material --------------------------------------------------------------

SUBJECTS = (
    "black holes", "the French revolution", "compound interest", "neural networks",
    "climate change", "the human heart", "sourdough starters", "quantum computing",
    "the stock market", "ancient Egypt", "plate tectonics", "the immune system",
    "renewable energy", "job interviews", "writing a resume", "learning to swim",
    "houseplants", "the solar system", "dinosaurs", "the Olympic games", "soccer",
    "basketball", "yoga", "nutrition", "vitamins", "dogs", "cats", "horses", "whales",
    "coral reefs", "airplanes", "rockets", "satellites", "smartphones", "email etiquette",
    "password security", "databases", "sorting algorithms", "recursion", "linked lists",
    "hash tables", "regular expressions", "unit testing", "git branches", "Linux shell",
    "web servers", "HTTP", "JSON", "SQL joins", "object-oriented programming",
    "functional programming", "Python decorators", "Python generators", "list comprehensions",
    "exceptions in Python", "file handling", "multithreading", "APIs", "cloud computing",
    "machine learning", "statistics", "probability", "prime numbers", "geometry",
    "fractions", "algebra", "calculus", "the Pythagorean theorem", "the speed of light",
    "gravity", "magnets", "electricity", "batteries", "the periodic table", "chemical reactions",
    "DNA", "evolution", "the brain", "memory techniques", "procrastination", "time management",
    "budgeting", "investing", "taxes", "renting an apartment", "moving to a new city",
    "travelling on a budget", "camping", "fishing", "painting", "photography", "film making",
    "classical music", "learning guitar", "poetry", "novels", "Shakespeare", "mythology",
    "democracy", "elections", "the United Nations", "world war two", "the industrial revolution",
    "medieval castles", "pirates", "the Silk Road", "languages of the world", "grammar",
    "punctuation", "writing an essay", "giving feedback", "teamwork", "leadership",
    "starting a business", "marketing", "customer service", "negotiation", "kindness",
    "happiness", "stress", "exercise", "walking", "cycling to work", "city planning",
    "architecture", "skyscrapers", "farming", "tea", "chocolate", "pizza", "pasta",
    "vegetarian cooking", "food waste", "plastic pollution", "forests", "rivers", "lakes",
    "mountains", "weather forecasts", "hurricanes", "lightning", "rainbows", "the seasons",
    "birds", "butterflies", "ants", "sharks", "penguins", "elephants", "zoos", "space travel",
    "Mars", "telescopes", "the Big Bang", "computers", "keyboards", "video games",
    "social media", "online privacy", "artificial intelligence", "self-driving cars",
    "3D printing", "virtual reality", "blockchain", "encryption", "compilers",
    "operating systems", "memory management", "networking", "Wi-Fi", "data visualization",
)

QUESTION_TEMPLATES = (
    "Write a question that someone might ask an AI assistant about {x}. Reply with the question only.",
    "Write a short request a user could send to a chatbot about {x}. Reply with the request only.",
    "Imagine a student who is learning about {x}. Write one question they would ask. Only write the question.",
    "Write a Python programming task related to {x}, phrased as a request to an assistant. "
    "Reply with the request only.",
    "Write an instruction asking an assistant for help with something related to {x}. "
    "Only write the instruction.",
    "What is a good question to ask an expert about {x}? Write just the question.",
)

DOC_TEMPLATES = (
    "Explain this:\n\n{x}",
    "Summarise:\n\n{x}",
    "Summarise the following text in a few sentences:\n\n{x}",
    "Explain this in simple terms:\n\n{x}",
    "Give an example of how to use what this describes:\n\n{x}",
    "What are the key points of this documentation?\n\n{x}",
)
TASK_TEMPLATES = (
    "Write a Python function to {x}",
    "Write a function that does the following: {x}",
    "Show how to {x} in Python, with a short explanation.",
)
CODE_TEMPLATES = (
    "Explain this code:\n\n```python\n{x}\n```",
    "What does this Python function do?\n\n```python\n{x}\n```",
    "Add comments to this function that explain each step:\n\n```python\n{x}\n```",
    "Write unit tests for this function:\n\n```python\n{x}\n```",
    "Is there a bug or something to improve in this code?\n\n```python\n{x}\n```",
    "Rewrite this function to be simpler and easier to read:\n\n```python\n{x}\n```",
)
FOLLOWUPS = (
    "Can you give me an example?", "Can you explain that more simply?", "Thanks! Can you make it shorter?",
    "Why is that?", "What are common mistakes to avoid?", "Can you go into more detail?",
    "How would I explain this to a child?", "Can you summarise that in three bullet points?",
    "What should I learn next?", "Is there another way to do it?", "Can you show that in Python?",
    "What are the advantages and disadvantages?", "Can you give me a real-world use case?",
    "I don't understand the last part. Can you clarify?", "Could you write that as a list of steps?",
    "What would an expert add to this?", "Can you check your answer for mistakes?",
    "How does this compare to the alternatives?", "Please continue.", "Can you make it more formal?",
)
_TASK_VERBS = {"return", "returns", "compute", "computes", "convert", "converts", "create", "creates",
               "split", "splits", "remove", "removes", "find", "finds", "check", "checks", "read", "reads",
               "write", "writes", "encode", "encodes", "decode", "decodes", "format", "formats", "parse",
               "parses", "test", "tests", "make", "makes", "build", "builds", "get", "gets", "set", "sets",
               "add", "adds", "count", "counts", "calculate", "calculates", "search", "searches",
               "replace", "replaces", "join", "joins", "copy", "copies", "sort", "sorts"}
_STOPWORDS = {"which", "there", "their", "these", "those", "where", "would", "should", "could", "about",
              "after", "before", "being", "other", "since", "until", "while", "whose", "within", "without",
              "always", "return", "returns", "value", "values", "object", "objects", "called", "using",
              "given", "default", "argument", "arguments", "following", "because", "otherwise", "example"}


def corpus_words(texts: list[str], min_count: int = 3) -> list[str]:
    """Nouns of ``texts``, roughly: lowercase words (5-14 letters) seen at least
    ``min_count`` times right after "the", sorted."""
    counts = Counter(w.lower() for t in texts for w in re.findall(r"\b[Tt]he ([a-z]{5,14})\b", t))
    reserved = {w for p in tuning_prompts() for w in re.findall(r"[a-z]+", p.text.lower())}
    return sorted(w for w, c in counts.items() if c >= min_count and w not in _STOPWORDS and w not in reserved)


def stdlib_snippets(max_chars: int, min_lines: int = 4, max_lines: int = 40) -> list[str]:
    """The source of small public functions and methods of ``corpus.STDLIB_MODULES``,
    dedented, in a fixed order (modules in list order, members by name)."""
    import importlib

    from treespark.corpus import STDLIB_MODULES

    out: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            module = importlib.import_module(name)
            for obj in _functions(module):
                try:
                    src = textwrap.dedent(inspect.getsource(obj)).strip()
                except (OSError, TypeError):
                    continue
                n = src.count("\n") + 1
                if min_lines <= n <= max_lines and len(src) <= max_chars:
                    out.append(src)
    return list(dict.fromkeys(out))


def _functions(module) -> Iterator[object]:
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield obj
        elif inspect.isclass(obj):
            for mname, m in sorted(vars(obj).items()):
                if not mname.startswith("_") and inspect.isfunction(m):
                    yield m


def default_sources(max_snippet_chars: int = GenConfig.max_snippet_chars) -> Sources:
    """``SUBJECTS`` plus corpus words; the corpus minus the train prompts; stdlib sources."""
    from treespark.corpus import training_texts

    train = {p.text.strip() for p in load_prompts("train")}
    texts = training_texts()
    docs = tuple(t for t in texts if t not in train)
    return Sources(subjects=tuple(SUBJECTS), words=tuple(corpus_words(docs)), docs=docs,
                   snippets=tuple(stdlib_snippets(max_snippet_chars)))


# -- pure parts ------------------------------------------------------------------------

def cut_repetition(tokens: list[int], n: int = 8, repeats: int = 3) -> list[int]:
    """``tokens`` cut at the start of the first ``repeats``-th occurrence of any
    ``n``-gram (a loop of period p keeps about ``repeats - 1`` periods plus ``n``)."""
    seen: Counter[tuple[int, ...]] = Counter()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        seen[gram] += 1
        if seen[gram] >= repeats:
            return tokens[:i]
    return list(tokens)


def is_degenerate(tokens: list[int], text: str, min_tokens: int) -> bool:
    """Empty, too short, or mostly a few tokens over and over."""
    if len(tokens) < min_tokens or not text.strip():
        return True
    return len(tokens) >= 40 and len(set(tokens)) < 0.1 * len(tokens)


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def reserved_texts() -> frozenset[str]:
    """Heldout and tuning prompts, normalised: never a generated request."""
    return frozenset(normalise(p.text) for p in (*load_prompts("heldout"), *tuning_prompts()))


def assert_not_reserved(texts: list[str], reserved: frozenset[str]) -> None:
    bad = [t for t in texts if normalise(t) in reserved]
    if bad:
        raise AssertionError(f"generated requests equal heldout/tuning prompts: {bad[:3]!r}")


_STARTERS = {"write", "explain", "create", "describe", "give", "list", "tell", "show", "help", "implement",
             "make", "suggest", "compare", "summarize", "summarise", "design", "generate", "please", "i",
             "can", "could", "how", "what", "why", "when", "where", "which", "who", "is", "are", "do", "does",
             "should", "would", "find", "provide", "develop", "build", "convert", "calculate", "teach"}


def clean_question(text: str, reserved: frozenset[str]) -> str | None:
    """The request in a target-written question: its first line that asks something (ends
    a sentence with '?', kept up to there) or starts like a request; None if none does."""
    for line in text.strip().splitlines():
        q = re.sub(r"^(user|question|request|instruction|task)\s*\d*\s*:\s*", "", line.strip(), flags=re.I)
        q = q.strip().strip('"“”\'*').strip()
        if "?" in q:
            q = q[: q.index("?") + 1]
        elif not q or q.split()[0].lower().strip(",'’") not in _STARTERS:
            continue
        if len(q) >= 10 and len(q.split()) >= 3 and len(q) <= 400 and normalise(q) not in reserved:
            return q
    return None


def _piece(rng: random.Random, text: str, max_chars: int) -> str:
    """A run of whole paragraphs from a random paragraph on, at most ``max_chars`` (a single
    longer paragraph is cut at a line or word)."""
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    i = rng.randrange(len(paras))
    out = paras[i]
    for p in paras[i + 1:]:
        if len(out) + 2 + len(p) > max_chars:
            break
        out += "\n\n" + p
    if len(out) > max_chars:
        cut = out[:max_chars]
        out = cut[: max(cut.rfind("\n"), cut.rfind(" "), max_chars // 2)]
    return out.strip()


def _task(text: str) -> str | None:
    """'Write a function to ...' material: a docstring's first sentence that starts with a
    task verb, in the imperative and lowercased ('Return the ...' -> 'return the ...')."""
    first = re.split(r"(?<=\.)\s|\n\n", text.strip(), maxsplit=1)[0].replace("\n", " ").strip()
    words = first.split()
    if not (4 <= len(words) <= 40) or words[0].lower() not in _TASK_VERBS:
        return None
    verb = words[0].lower()
    if verb.endswith("ies"):
        verb = verb[:-3] + "y"
    elif verb.endswith(("ches", "shes", "sses")):
        verb = verb[:-2]
    elif verb.endswith("s") and verb[:-1] in _TASK_VERBS:
        verb = verb[:-1]
    return " ".join([verb, *words[1:]]).rstrip(".") + "."


@dataclass(frozen=True)
class Plan:
    """One first-turn request of a shard and its pre-drawn choices."""

    kind: int                  # KIND_SELF, KIND_DOC or KIND_CODE
    text: str                  # the request; for KIND_SELF, the question-writing request
    temperature: float         # of its answers (first and follow-up)
    followup: str | None       # the follow-up turn, if this conversation gets one


def plan_shard(cfg: GenConfig, sources: Sources, shard: int, reserved: frozenset[str]) -> list[Plan]:
    """The shard's requests: a pure function of (config, sources, shard index)."""
    rng = random.Random(f"{cfg.version}/{cfg.seed}/{shard}")
    plans: list[Plan] = []
    while len(plans) < cfg.conversations:
        kind = rng.choices((KIND_SELF, KIND_DOC, KIND_CODE), weights=cfg.mix)[0]
        temperature = 0.0 if rng.random() < cfg.greedy_fraction else rng.choice(cfg.temperatures)
        followup = rng.choice(FOLLOWUPS) if rng.random() < cfg.followup_fraction else None
        if kind == KIND_SELF:
            pool = sources.subjects if rng.random() < cfg.subject_fraction else sources.words
            text = rng.choice(QUESTION_TEMPLATES).format(x=rng.choice(pool))
        elif kind == KIND_CODE:
            text = rng.choice(CODE_TEMPLATES).format(x=rng.choice(sources.snippets))
        else:
            doc = rng.choice(sources.docs)
            task = _task(doc) if rng.random() < 0.25 else None
            text = (rng.choice(TASK_TEMPLATES).format(x=task) if task
                    else rng.choice(DOC_TEMPLATES).format(x=_piece(rng, doc, cfg.max_snippet_chars)))
        if normalise(text) in reserved:
            continue
        plans.append(Plan(kind, text, temperature, followup))
    return plans


def request_seed(cfg: GenConfig, shard: int, index: int, turn: int) -> int:
    """The sampling seed of request ``index`` of ``shard`` at ``turn`` (0: question, 1, 2)."""
    key = f"{cfg.version}/{cfg.seed}/{shard}/{index}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


# -- the target writes -----------------------------------------------------------------

Progress = Callable[[int], None]


def run_requests(engine, tag: str, prompts: list[list[int]], params: list[SamplingParams],
                 on_tokens: Progress | None = None) -> list[list[int]]:
    """Each prompt's answer through ``engine`` (the public API only), in prompt order;
    ``tag`` keeps request ids distinct between calls."""
    base = f"{tag}-"
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{base}{i}", p, sp)
    answers: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            answers[int(out.request_id[len(base):])] += out.new_token_ids
            if on_tokens is not None:
                on_tokens(len(out.new_token_ids))
    return answers


def make_shard(pair: ModelPair, cfg: GenConfig, sources: Sources, shard: int,
               on_tokens: Progress | None = None) -> list[Sample]:
    """The samples of shard ``shard``: questions written, first turns and follow-ups answered."""
    from treespark.engine import Engine, EngineConfig

    tok = pair.tokenizer
    assert tok is not None, "make_shard needs a pair with a tokenizer"
    reserved = reserved_texts()
    stop = (tok.eos_token_id,)
    engine = Engine(pair, EngineConfig(max_batch_size=cfg.batch_size, max_context=cfg.max_context),
                    budget=Budget.off())
    plans = plan_shard(cfg, sources, shard, reserved)
    samples: list[Sample] = []
    requests: list[str] = []  # every user turn sent, checked against the reserved prompts

    def finish(ids: list[int]) -> tuple[list[int], bool]:
        kept = cut_repetition(ids, cfg.ngram, cfg.ngram_repeats)
        ok = not is_degenerate(kept, tok.decode(kept, skip_special_tokens=True), cfg.min_answer_tokens)
        return kept, ok

    # 1. the target writes the self-written requests
    selfs = [j for j, p in enumerate(plans) if p.kind == KIND_SELF]
    q_prompts = [chat_ids(tok, plans[j].text) for j in selfs]
    q_params = [SamplingParams(temperature=cfg.question_temperature, max_tokens=cfg.max_question_tokens,
                               stop_token_ids=stop, seed=request_seed(cfg, shard, j, 0)) for j in selfs]
    firsts: dict[int, str] = {j: p.text for j, p in enumerate(plans) if p.kind != KIND_SELF}
    for j, prompt, ids in zip(selfs, q_prompts, run_requests(engine, "q", q_prompts, q_params, on_tokens), strict=True):
        requests.append(plans[j].text)
        kept, ok = finish(ids)
        if ok:
            samples.append(Sample(prompt + kept, len(prompt), KIND_WRITE_QUESTION, cfg.question_temperature))
        q = clean_question(tok.decode(kept, skip_special_tokens=True), reserved) if ok else None
        if q is not None:
            firsts[j] = q

    # 2. first turns
    order = sorted(firsts)
    prompts = [chat_ids(tok, firsts[j]) for j in order]
    keep = [k for k, p in enumerate(prompts) if len(p) <= cfg.max_prompt_tokens]
    order, prompts = [order[k] for k in keep], [prompts[k] for k in keep]
    params = [SamplingParams(temperature=plans[j].temperature, max_tokens=cfg.max_answer_tokens,
                             stop_token_ids=stop, seed=request_seed(cfg, shard, j, 1)) for j in order]
    f_prompts: list[list[int]] = []
    f_index: list[int] = []
    for j, prompt, ids in zip(order, prompts, run_requests(engine, "a", prompts, params, on_tokens), strict=True):
        requests.append(firsts[j])
        kept, ok = finish(ids)
        if not ok:
            continue
        samples.append(Sample(prompt + kept, len(prompt), plans[j].kind, plans[j].temperature))
        followup = plans[j].followup
        if followup is None or len(kept) < len(ids) or kept[-1] not in stop:
            continue  # only complete, uncut answers get a follow-up
        messages = [{"role": "user", "content": firsts[j]},
                    {"role": "assistant", "content": tok.decode(kept, skip_special_tokens=True).strip()},
                    {"role": "user", "content": followup}]
        ids2 = chat_ids(tok, messages)
        if len(ids2) + cfg.max_answer_tokens <= cfg.max_context:
            f_prompts.append(ids2)
            f_index.append(j)
            requests.append(followup)

    # 3. follow-ups
    f_params = [SamplingParams(temperature=plans[j].temperature, max_tokens=cfg.max_answer_tokens,
                               stop_token_ids=stop, seed=request_seed(cfg, shard, j, 2)) for j in f_index]
    for j, prompt, ids in zip(f_index, f_prompts, run_requests(engine, "f", f_prompts, f_params, on_tokens),
                              strict=True):
        kept, ok = finish(ids)
        if ok:
            samples.append(Sample(prompt + kept, len(prompt), KIND_FOLLOWUP, plans[j].temperature))
    assert_not_reserved(requests, reserved)
    return samples


# -- shards on disk --------------------------------------------------------------------

def shard_path(out_dir: Path, shard: int) -> Path:
    return out_dir / f"shard-{shard:05d}.npz"


def write_shard(path: Path, samples: list[Sample], meta: dict) -> None:
    """Write ``samples`` atomically: a temp file in the same folder, fsync, rename."""
    tokens = np.fromiter((t for s in samples for t in s.tokens), dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise ValueError("token ids must fit in uint16")
    offsets = np.cumsum([0] + [len(s.tokens) for s in samples]).astype(np.int32)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f, tokens=tokens.astype(np.uint16), offsets=offsets,
            answer_start=np.array([s.answer_start for s in samples], dtype=np.int32),
            kind=np.array([s.kind for s in samples], dtype=np.uint8),
            temperature=np.array([s.temperature for s in samples], dtype=np.float32),
            meta=np.array(json.dumps(meta, sort_keys=True)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[list[Sample], dict]:
    with np.load(path, allow_pickle=False) as z:
        tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
        samples = [Sample(tokens[offsets[i]:offsets[i + 1]].tolist(), int(a), int(k), round(float(t), 4))
                   for i, (a, k, t) in enumerate(zip(z["answer_start"], z["kind"], z["temperature"], strict=True))]
        return samples, json.loads(str(z["meta"]))


def shard_meta(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["meta"]))


def finished_shards(out_dir: Path) -> list[int]:
    if not out_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in out_dir.iterdir() if (m := SHARD_RE.match(p.name)))


def load_answers(out_dir: str | Path) -> tuple[list[list[int]], list[int]]:
    """Every committed shard's sequences and where each one's answer begins."""
    sequences: list[list[int]] = []
    starts: list[int] = []
    for i in finished_shards(Path(out_dir)):
        samples, _ = read_shard(shard_path(Path(out_dir), i))
        sequences += [s.tokens for s in samples]
        starts += [s.answer_start for s in samples]
    return sequences, starts


def write_manifest(out_dir: Path) -> dict:
    """``manifest.json``: rebuilt from the shards' own metadata (atomically)."""
    shards = [shard_meta(shard_path(out_dir, i)) for i in finished_shards(out_dir)]
    manifest = {
        "shards": len(shards),
        "sequences": sum(m["sequences"] for m in shards),
        "tokens": sum(m["tokens"] for m in shards),
        "answer_tokens": sum(m["answer_tokens"] for m in shards),
        "configs": sorted({json.dumps(m["config"], sort_keys=True) for m in shards}),
        "per_shard": [{k: m[k] for k in ("shard", "sequences", "tokens", "answer_tokens", "sources")}
                      for m in shards],
    }
    manifest["configs"] = [json.loads(c) for c in manifest["configs"]]
    tmp = out_dir / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out_dir / "manifest.json")
    return manifest


def generate_shards(pair: ModelPair, cfg: GenConfig, sources: Sources, out_dir: Path, *,
                    target_tokens: int | None = None, max_shards: int | None = None,
                    progress: bool = True) -> list[int]:
    """Write missing shards (lowest index first) until the committed answer tokens reach
    ``target_tokens`` or ``max_shards`` shards exist; returns the shards written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".shard-*.npz.tmp"):
        stale.unlink()  # a run killed while writing
    done = finished_shards(out_dir)
    metas = [shard_meta(shard_path(out_dir, i)) for i in done]
    for m in metas:
        if m["config_digest"] != cfg.digest():
            raise ValueError(f"{out_dir} holds shard {m['shard']} of another config ({m['config']}); "
                             "use another --out or the same settings")
        if m["sources"] != sources.digest():
            print(f"warning: shard {m['shard']} was built from other sources (another Python?)",
                  file=sys.stderr)
    total = sum(m["answer_tokens"] for m in metas)
    written: list[int] = []
    bar = tqdm(total=target_tokens, initial=total, unit="tok", desc="answer tokens", disable=not progress,
               file=sys.stderr)
    t_run, made, last_log = time.perf_counter(), 0, [time.perf_counter()]

    def on_tokens(n: int) -> None:
        nonlocal made
        made += n
        now = time.perf_counter()
        if progress and now - last_log[0] >= 60:
            last_log[0] = now
            bar.set_postfix_str(f"shard {shard}, {made} generated, {made / (now - t_run):.1f} tok/s", refresh=True)

    while (target_tokens is None or total < target_tokens) and (max_shards is None or len(done) < max_shards):
        shard = next(i for i in range(len(done) + 1) if i not in done)
        t0, before = time.perf_counter(), made
        samples = make_shard(pair, cfg, sources, shard, on_tokens)
        seconds = time.perf_counter() - t0
        answer_tokens = sum(len(s.tokens) - s.answer_start for s in samples)
        meta = {"shard": shard, "version": cfg.version, "seed": cfg.seed, "config": asdict(cfg),
                "config_digest": cfg.digest(), "sources": sources.digest(), "sequences": len(samples),
                "tokens": sum(len(s.tokens) for s in samples), "answer_tokens": answer_tokens}
        write_shard(shard_path(out_dir, shard), samples, meta)
        write_manifest(out_dir)
        done = sorted([*done, shard])
        written.append(shard)
        total += answer_tokens
        bar.update(answer_tokens)
        print(f"shard {shard:05d}: {len(samples)} sequences, {meta['tokens']} tokens, {answer_tokens} answer "
              f"tokens kept; {made - before} generated in {seconds:.0f} s ({(made - before) / seconds:.1f} "
              f"tok/s); total {total} answer tokens, {made / (time.perf_counter() - t_run):.1f} tok/s this run",
              file=sys.stderr, flush=True)
    bar.close()
    return written

"""Where the requests come from: the offline material (``Sources``: subjects, corpus
words, documentation pieces, stdlib function sources), the templates that turn it into
requests, the questions the target writes (``clean_question``), and a shard's plan
(``plan_shard``: a pure function of config, sources and shard index)."""

from __future__ import annotations

import hashlib
import inspect
import random
import re
import textwrap
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from treespark.models.prompts import load_prompts, tuning_prompts
from treespark.training.datagen.config import GenConfig
from treespark.training.datagen.reserved import normalise
from treespark.training.datagen.shards import KIND_CHAT, KIND_CODE, KIND_DOC, KIND_SELF


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
# Requests shaped like the held-out chat prompts (a plot to summarise, an email, a poem,
# an explanation, tips, pros and cons, a description, a dialogue), on other subjects.
CHAT_TEMPLATES = (
    "Summarize the plot of a short story about {x}.",
    "Write a friendly email to a friend telling them about {x}.",
    "Write a short poem about {x}.",
    "Explain what {x} is and why it matters.",
    "Explain {x} in four or five sentences.",
    "Give three tips for someone getting started with {x}.",
    "What are the pros and cons of {x}?",
    "Why do people find {x} interesting?",
    "Describe {x} to someone who has never heard of it.",
    "How do I start a conversation about {x} with a stranger?",
    "Explain {x} in simple words.",
    "Write a short dialogue between two friends about {x}.",
    "Summarize what a beginner should know about {x}.",
    "What is the polite way to tell a friend you are not interested in {x}?",
    "Write a short story in which {x} plays a surprising role.",
    "What are common misconceptions about {x}?",
)
# words a subject may share with a held-out or tuning prompt (the templates' own words),
# spelt as _content_words leaves them ("tips" -> "tip", "does" -> "doe")
_GENERIC_WORDS = {"explain", "what", "write", "give", "short", "about", "three", "tip", "simple", "word",
                  "difference", "between", "function", "python", "that", "with", "this", "someone", "when",
                  "from", "your", "them", "their", "into", "they", "have", "make", "describe", "first",
                  "year", "keep", "doe", "there"}
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


def _content_words(text: str) -> set[str]:
    return {w.rstrip("s") for w in re.findall(r"[a-z]{4,}", text.lower())}


def chat_subjects(pool: tuple[str, ...], reserved: frozenset[str]) -> tuple[str, ...]:
    """The subjects of ``pool`` that share no content word with a reserved (held-out or
    tuning) prompt, so that no chat request asks a held-out question in other words."""
    banned = set().union(*(_content_words(t) for t in reserved)) - _GENERIC_WORDS
    return tuple(x for x in pool if not _content_words(x) & banned)


def stdlib_snippets(max_chars: int, min_lines: int = 4, max_lines: int = 40) -> list[str]:
    """The source of small public functions and methods of ``corpus.STDLIB_MODULES``,
    dedented, in a fixed order (modules in list order, members by name)."""
    import importlib

    from treespark.training.corpus import STDLIB_MODULES

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
    from treespark.training.corpus import training_texts

    train = {p.text.strip() for p in load_prompts("train")}
    texts = training_texts()
    docs = tuple(t for t in texts if t not in train)
    return Sources(subjects=tuple(SUBJECTS), words=tuple(corpus_words(docs)), docs=docs,
                   snippets=tuple(stdlib_snippets(max_snippet_chars)))


# -- the questions the target writes ---------------------------------------------------

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


# -- a shard's plan --------------------------------------------------------------------

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

    kind: int                  # KIND_SELF, KIND_DOC, KIND_CODE or KIND_CHAT
    text: str                  # the request; for KIND_SELF, the question-writing request
    temperature: float         # of its answers (first and follow-up)
    followup: str | None       # the follow-up turn, if this conversation gets one


def plan_shard(cfg: GenConfig, sources: Sources, shard: int, reserved: frozenset[str]) -> list[Plan]:
    """The shard's requests: a pure function of (config, sources, shard index)."""
    rng = random.Random(f"{cfg.version}/{cfg.seed}/{shard}")
    kinds = (KIND_SELF, KIND_DOC, KIND_CODE, KIND_CHAT)[: len(cfg.mix)]
    chat_pools: tuple[tuple[str, ...], ...] = ((), ())
    if KIND_CHAT in kinds:
        chat_pools = (chat_subjects(sources.subjects, reserved), chat_subjects(sources.words, reserved))
        if not all(chat_pools):
            raise ValueError("chat requests need subjects and words that share nothing with the reserved prompts")
    plans: list[Plan] = []
    while len(plans) < cfg.conversations:
        kind = rng.choices(kinds, weights=cfg.mix)[0]
        temperature = 0.0 if rng.random() < cfg.greedy_fraction else rng.choice(cfg.temperatures)
        followup = rng.choice(FOLLOWUPS) if rng.random() < cfg.followup_fraction else None
        if kind == KIND_SELF:
            pool = sources.subjects if rng.random() < cfg.subject_fraction else sources.words
            text = rng.choice(QUESTION_TEMPLATES).format(x=rng.choice(pool))
        elif kind == KIND_CODE:
            text = rng.choice(CODE_TEMPLATES).format(x=rng.choice(sources.snippets))
        elif kind == KIND_CHAT:
            pool = chat_pools[0] if rng.random() < cfg.subject_fraction else chat_pools[1]
            text = rng.choice(CHAT_TEMPLATES).format(x=rng.choice(pool))
        else:
            doc = rng.choice(sources.docs)
            task = _task(doc) if rng.random() < 0.25 else None
            text = (rng.choice(TASK_TEMPLATES).format(x=task) if task
                    else rng.choice(DOC_TEMPLATES).format(x=_piece(rng, doc, cfg.max_snippet_chars)))
        if normalise(text) in reserved:
            continue
        plans.append(Plan(kind, text, temperature, followup))
    return plans

"""Offline text for drafter distillation, available on any machine with Python.

A drafter is distilled on the target's behaviour over some text; this module gathers
that text without a network or a dataset download:

1. the project's train-split prompts (``treespark.models.prompts``; heldout prompts never),
2. the reference topics that ship with the interpreter for ``help()``
   (``pydoc_data.topics``: the language reference, prose with code),
3. the docstrings of a fixed list of standard-library modules, of their public
   functions and classes, and of those classes' public methods.

The order is fixed (the order above; topics by name; modules in ``STDLIB_MODULES``
order; members by name), so the result is deterministic for a given interpreter.
Pieces are stripped, deduplicated, and stdlib pieces shorter than ``MIN_CHARS`` are
dropped. Any piece containing a heldout prompt's text is dropped as well.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Iterator

from treespark.models.prompts import load_prompts

MIN_CHARS = 80  # stdlib pieces shorter than this are mostly one-line stubs

# Modules that exist, import without side effects or deprecation warnings, on 3.10+.
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio.events", "asyncio.futures",
    "asyncio.locks", "asyncio.queues", "asyncio.streams", "asyncio.subprocess",
    "asyncio.tasks", "base64", "bdb", "bisect", "calendar", "cmd", "code", "codecs",
    "collections", "collections.abc", "concurrent.futures", "configparser", "contextlib",
    "contextvars", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "doctest", "email.message", "email.utils", "enum", "filecmp", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib",
    "heapq", "hmac", "html", "html.parser", "http.client", "http.cookiejar",
    "http.cookies", "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools",
    "json", "json.decoder", "json.encoder", "keyword", "linecache", "locale", "logging",
    "logging.handlers", "lzma", "mailbox", "math", "mimetypes", "multiprocessing.pool",
    "numbers", "operator", "optparse", "os", "os.path", "pathlib", "pdb", "pickle",
    "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "pstats",
    "queue", "random", "re", "reprlib", "runpy", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3",
    "ssl", "stat", "statistics", "string", "struct", "subprocess", "sys", "sysconfig",
    "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "trace",
    "traceback", "types", "typing", "unicodedata", "unittest", "unittest.mock",
    "urllib.parse", "urllib.request", "urllib.robotparser", "uuid", "warnings", "weakref",
    "wsgiref.util", "xml.dom.minidom", "xml.etree.ElementTree", "xml.sax", "zipfile",
    "zlib", "zoneinfo",
)  # fmt: skip


def training_texts(max_chars: int | None = None) -> list[str]:
    """The distillation texts in a fixed order; with ``max_chars``, a prefix of that
    list holding exactly ``min(max_chars, total)`` characters (the last piece cut)."""
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0 or None, got {max_chars}")
    heldout = [p.text for p in load_prompts(split="heldout")]
    texts: list[str] = []
    seen: set[str] = set()
    total = 0
    for text in _pieces():
        if text in seen or any(h in text for h in heldout):
            continue
        seen.add(text)
        if max_chars is not None and total + len(text) >= max_chars:
            if max_chars > total:
                texts.append(text[: max_chars - total])
            break
        texts.append(text)
        total += len(text)
    return texts


def _pieces() -> Iterator[str]:
    for p in load_prompts(split="train"):
        yield p.text.strip()
    for text in _pydoc_topics():
        if len(text) >= MIN_CHARS:
            yield text
    for name in STDLIB_MODULES:
        for text in _module_docstrings(name):
            if len(text) >= MIN_CHARS:
                yield text


def _pydoc_topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key].strip()


def _module_docstrings(name: str) -> Iterator[str]:
    """The docstrings of module ``name``, then of its public functions and classes
    defined there (by name), each class followed by its public methods' docstrings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(name)
        members = sorted(vars(module).items())
        yield from _doc(module)
        for attr, obj in members:
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            yield from _doc(obj)
            if inspect.isclass(obj):
                for method_name, method in sorted(vars(obj).items()):
                    if method_name.startswith("_"):
                        continue
                    if isinstance(method, (staticmethod, classmethod)):
                        method = method.__func__
                    # Skip methods patched in by third-party code (e.g. on logging.Logger),
                    # so the result does not depend on what else the process imported.
                    code = method.fget if isinstance(method, property) else method
                    if getattr(code, "__module__", module.__name__) != module.__name__:
                        continue
                    if (
                        inspect.isfunction(method)
                        or inspect.ismethoddescriptor(method)
                        or isinstance(method, property)
                    ):
                        yield from _doc(method)


def _doc(obj: object) -> Iterator[str]:
    doc = getattr(obj, "__doc__", None)
    if isinstance(doc, str) and doc.strip():
        yield inspect.cleandoc(doc)

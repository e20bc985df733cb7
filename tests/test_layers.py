"""The import graph has layers and no cycles.

Every import counts, at module level or inside a function, under ``TYPE_CHECKING`` too:
a lazy import is still a dependency. Layers, lowest first (a module imports only its own
layer or lower):

* the library: ``treespark.kernels < spec < pricing < models < engine < training < bench
  < cli``; the package root only names public objects lazily;
* serving: ``deployments``' shared modules (config, metrics, reports, placement) <
  ``controller`` < ``replica`` and ``http`` < ``app``; the library never imports it;
* ``loadtests`` above both; nothing in them imports the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("treespark", "deployments", "loadtests")

LAYERS = {
    "treespark.kernels": 0, "treespark.spec": 1, "treespark.pricing": 2, "treespark.models": 3,
    "treespark.engine": 4, "treespark.training": 5, "treespark.bench": 6, "treespark.cli": 7,
    "deployments.config": 10, "deployments.metrics": 10, "deployments.reports": 10,
    "deployments.placement": 10, "deployments.controller": 11, "deployments.replica": 12,
    "deployments.http": 12, "deployments.app": 13,
    "loadtests": 20,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix of ``module`` in ``LAYERS``; None: a package root."""
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)] if prefixes else None


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import mod`` resolved to the module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return {m for m in out if m in modules}


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports(p, modules) - {module_name(p)} for p in files}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycles():
    assert cycles(graph()) == []


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for mod, deps in graph().items():
        here = layer_of(mod)
        for dep in deps:
            there = layer_of(dep)
            if here is not None and there is not None and there > here:
                upward.append(f"{mod} -> {dep}")
            if here is None and mod != "treespark" and mod != "deployments" and mod != "loadtests":
                upward.append(f"{mod} has no layer")
    assert sorted(upward) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The checks themselves can fail: a made-up graph with both defects."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert layer_of("treespark.spec.budget") < layer_of("treespark.engine.core")
    assert layer_of("treespark.cli") > layer_of("treespark.bench.common")

"""The import graph of ``src/expertcache``: no circles, and no layer imports one above it.

Every ``import`` of every module counts, inside functions and ``TYPE_CHECKING`` blocks
too (a lazy import is still a dependency). Nodes are modules (a package is its
``__init__``); ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module, else to ``pkg``. Layers are top-level packages (and modules) of
``expertcache``; ``LAYERS`` is the diagram in docs/architecture.md, which the last test
keeps equal to it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "expertcache"

# Top first. A package may import packages of lower rows only: not its own row's other
# packages (siblings stay independent: runtime never imports sim, nor sim runtime), not
# a row above. "expertcache" is the root __init__ (the public API, `offload` lazily).
LAYERS = [
    ("__main__",),
    ("cli",),
    ("expertcache", "serve", "bench"),
    ("integrations", "vllm"),
    ("loaders",),
    ("runtime", "sim"),
    ("imatrix", "costmodel", "lagged"),
    ("ggufmodel",),
    ("quant", "config"),
    ("cache",),
    ("policies",),
    ("trace",),
    ("stats", "keys", "presets", "sizes", "decode_phases"),
]

# Module edges allowed to close a circle: none since the policy branch moved the kernels
# under policies/ (the sim/replay.py <-> sim/kernels/lru.py circle is gone).
KNOWN: set[tuple[str, str]] = set()


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _edges() -> set[tuple[str, str]]:
    """(importer, imported) over every import statement of every module of expertcache."""
    modules, edges = _modules(), set()
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolved against the importing package
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:  # `import a.b.c` names a.b.c's module
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    edges.add((name, target))
    return edges


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else "expertcache"


ROW = {package: row for row, packages in enumerate(LAYERS) for package in packages}


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    edges = _edges()
    # a lazy import inside a function and a relative one are both seen
    assert ("expertcache", "expertcache.integrations.transformers") in edges
    assert ("expertcache.runtime.engine", "expertcache.costmodel") in edges
    assert len(edges) > 200


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()}
    assert packages - set(ROW) == set(), "place new packages in LAYERS and docs/architecture.md"
    assert set(ROW) - packages == set(), "LAYERS names a package that does not exist"


def test_no_import_circles():
    edges = _edges()
    missing = KNOWN - edges
    assert not missing, f"gone, delete from KNOWN: {sorted(missing)}"
    assert _cycles(edges - KNOWN) == []
    packages = {(_package(a), _package(b)) for a, b in edges if _package(a) != _package(b)}
    assert _cycles(packages) == []


def test_no_upward_or_sideways_imports():
    bad = sorted(f"{a} -> {b}" for a, b in _edges()
                 if _package(a) != _package(b) and ROW[_package(a)] >= ROW[_package(b)])
    assert bad == [], "a layer imports its own row or one above it (docs/architecture.md)"


def test_the_architecture_page_shows_these_layers():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## Layers.*?```\n(.*?)```", text, re.S).group(1)
    rows = [tuple(name.strip().rstrip("/") for name in line.split(" -- ")[0].split("|"))
            for line in block.splitlines() if " -- " in line]
    assert rows == LAYERS

"""The package's layers import downwards only, and no module imports itself back.

``platform`` < ``wire`` < ``core`` < ``transport`` < ``settings`` < ``endpoints``,
``integrations`` < the top (``lmshm.Server`` and the command lines, which compose the others).
``lmshm.quoting`` and ``lmshm._version`` are leaves below them all. docs/design/layers.md says why.

The graph is read from the source with ``ast``, not by importing it, so it sees every import
statement wherever it is: at module level, inside functions (lazy imports are edges too), under
``if TYPE_CHECKING:``; ``import x.y`` and ``from x import y``, relative ones resolved against
the importing module; and the lazy exports that ``importlib.import_module`` resolves (string
literals in that call, or in a module-level ``_EXPORTS`` table). ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg``. A package's ``__init__`` running
before its submodules is Python's import order, not an edge.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lmshm"

#: Rank of each layer: an import may go to a lower rank, or stay within its own layer.
#: ``endpoints`` and ``integrations`` share a rank and may not import each other.
LAYERS = {
    "base": 0,          # leaves every layer may use (quoting peer data, the version); import nothing
    "platform": 1,
    "wire": 2,          # the messages and their codec: the core takes and returns them as they are
    "core": 3,
    "transport": 4,     # the ZMTP listener, the fd channel, the worker client MPClient
    "settings": 5,      # lmshm.settings: ServerConfig, read by the endpoints and lmshm.Server
    "endpoints": 6,
    "integrations": 6,
    "top": 7,
}
#: Top-level modules of ``lmshm/`` (outside a layer's folder) and the layer each belongs to. A
#: new one must be placed here, so that nobody adds a module the rule does not see.
TOP_LEVEL = {
    "lmshm": "top",             # lazy public names over every layer
    "lmshm.server": "top",      # lmshm.Server and lmshm-server's command line
    "lmshm.cli": "top",         # the lmshm command
    "lmshm.quoting": "base",
    "lmshm._version": "base",   # lmshm.__version__
}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS and parts[1] not in ("base", "top"):
        return parts[1]
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    raise AssertionError(f"{module} is in no layer: move it into one of lmshm/{{platform,wire,core,transport,"
                         f"endpoints,integrations}}/, or place it in TOP_LEVEL in {Path(__file__).name}")


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _strings_of(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every lmshm module ``module`` imports, anywhere in it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                      else node.module or "")
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in known else source), node.lineno
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                for s in _strings_of(node.args[0]):
                    yield s, node.lineno
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS"
                                                  for t in node.targets):
            for s in _strings_of(node.value):
                if s in known:
                    yield s, node.lineno


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {imported lmshm module: first line that imports it}."""
    modules = discover(root)
    known = set(modules)
    top = root.name
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(module, path, known):
            if target != top and not target.startswith(top + "."):
                continue
            # "import lmshm.core.x.name" of a non-module: the nearest enclosing module
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != module:
                edges[target] = min(line, edges.get(target, line))
        graph[module] = edges
    return graph


def upward_imports(graph: dict[str, dict[str, int]], root: Path = PACKAGE) -> list[str]:
    problems = []
    for module, edges in sorted(graph.items()):
        here = layer_of(module)
        for target, line in sorted(edges.items()):
            there = layer_of(target)
            if there == here:
                continue
            if LAYERS[there] >= LAYERS[here]:
                kind = "sideways" if LAYERS[there] == LAYERS[here] else "upward"
                problems.append(f"{kind} import: {module} ({here}) imports {target} ({there}) "
                                f"at {_where(module, root)}:{line}")
    return problems


def _where(module: str, root: Path) -> str:
    path = discover(root)[module]
    return str(path.relative_to(root.parent))


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every
    module of one can reach every other, so each holds at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(components)


def _one_cycle(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest cycle start -> ... -> start inside one component (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def _describe_cycle(graph: dict[str, dict[str, int]], component: list[str], root: Path) -> str:
    cycle = _one_cycle(graph, set(component), component[0])
    hops = [f"{a} -> {b} ({_where(a, root)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    among = f" (one of several among {', '.join(component)})" if len(component) > len(cycle) - 1 else ""
    return "import cycle: " + "; ".join(hops) + among


def layering_problems(root: Path = PACKAGE) -> list[str]:
    graph = import_graph(root)
    return upward_imports(graph, root) + [_describe_cycle(graph, c, root) for c in cycles(graph)]


# ---- the rule, on lmshm itself -----------------------------------------------------------


def test_every_module_is_in_a_layer():
    for module in discover(PACKAGE):
        layer_of(module)


def test_lmshm_imports_only_downwards_and_has_no_cycle():
    problems = layering_problems()
    assert not problems, "lmshm's layers are broken:\n  " + "\n  ".join(problems)


# ---- the checker catches what it must (a package written for the purpose) ---------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "lmshm"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in root.rglob("*.py")} | {root}:
        (folder / "__init__.py").touch()
    return root


def test_checker_names_an_upward_import_inside_a_function(tmp_path):
    root = _package(tmp_path, {
        "core/service.py": "def f():\n    from lmshm.transport import client\n",
        "transport/client.py": "X = 1\n",
    })
    assert layering_problems(root) == [
        "upward import: lmshm.core.service (core) imports lmshm.transport.client (transport) "
        "at lmshm/core/service.py:2"]


def test_checker_resolves_relative_imports_and_type_checking_blocks(tmp_path):
    root = _package(tmp_path, {
        "platform/base/wrapper.py": "from ..registry import allowed\n",
        "platform/registry.py": "allowed = ()\n",
        "core/metrics.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..server import Server\n",
        "server.py": "",
    })
    assert layering_problems(root) == [
        "upward import: lmshm.core.metrics (core) imports lmshm.server (top) at lmshm/core/metrics.py:3"]
    assert import_graph(root)["lmshm.platform.base.wrapper"] == {"lmshm.platform.registry": 1}


def test_checker_names_every_hop_of_a_cycle_within_a_layer(tmp_path):
    root = _package(tmp_path, {
        "platform/a.py": "import lmshm.platform.b\n",
        "platform/b.py": "\n\ndef f():\n    from lmshm.platform import c\n",
        "platform/c.py": "from lmshm.platform.a import thing\n",
    })
    assert layering_problems(root) == [
        "import cycle: lmshm.platform.a -> lmshm.platform.b (lmshm/platform/a.py:1); "
        "lmshm.platform.b -> lmshm.platform.c (lmshm/platform/b.py:4); "
        "lmshm.platform.c -> lmshm.platform.a (lmshm/platform/c.py:1)"]


def test_checker_sees_lazy_exports_and_sideways_imports(tmp_path):
    root = _package(tmp_path, {
        "platform/__init__.py": "_EXPORTS = {'Thing': 'lmshm.core.thing'}\n",
        "core/thing.py": "import importlib\nimportlib.import_module('lmshm.integrations.x')\n",
        "integrations/x.py": "",
        "endpoints/http.py": "from lmshm.integrations import x\n",
    })
    assert layering_problems(root) == [
        "upward import: lmshm.core.thing (core) imports lmshm.integrations.x (integrations) "
        "at lmshm/core/thing.py:2",
        "sideways import: lmshm.endpoints.http (endpoints) imports lmshm.integrations.x (integrations) "
        "at lmshm/endpoints/http.py:1",
        "upward import: lmshm.platform (platform) imports lmshm.core.thing (core) at lmshm/platform/__init__.py:1"]


def test_checker_refuses_a_module_outside_the_layers(tmp_path):
    root = _package(tmp_path, {"helpers.py": ""})
    with pytest.raises(AssertionError, match=r"lmshm.helpers is in no layer"):
        layering_problems(root)

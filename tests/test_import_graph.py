"""No import cycles among the project's modules, lazy (function-level) imports included.

The graph is built from the source (AST), not by importing: an edge A -> B for every `import` /
`from ... import` / `importlib.import_module("...")` in A that names a project module B, except
imports under `if TYPE_CHECKING:` (annotations only). A cycle fails the test with its modules and
their edges. The detector is tested on a planted cycle first, so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = ("sparserl_mcore", "model_providers", "tools", "launchers")


def _modules(repo: pathlib.Path, roots: tuple[str, ...]) -> dict[str, pathlib.Path]:
    found = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _project_module(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """`name` or its closest enclosing project module (`pkg.mod.attr` -> `pkg.mod`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` depends on pkg.mod; `from pkg import name` on pkg. (Importing a
            # submodule also runs its package's __init__; that implicit step is not an edge.)
            names.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            )
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "importlib.import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    return names


def import_graph(repo: pathlib.Path, roots: tuple[str, ...]) -> dict[str, set[str]]:
    modules = _modules(repo, roots)
    graph = {}
    for module, path in modules.items():
        targets = {_project_module(name, modules) for name in _imported_names(module, path, modules)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_detector_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")  # lazy and relative
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('pkg.a')\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "e.py").write_text("from pkg.d import x\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_project_has_no_import_cycles():
    graph = import_graph(REPO, ROOTS)
    assert "sparserl_mcore.trainer.loop" in graph and "launchers.train" in graph
    found = cycles(graph)
    detail = "; ".join(" ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found)
    assert not found, f"import cycles: {detail}"

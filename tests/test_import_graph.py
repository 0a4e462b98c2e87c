"""The module import graph of sparrow/ has no cycle (``docs/architecture.md``, "Packages and layers": kernels/ never
imports layers/).

The graph is read from the source with ``ast``, not by importing: every ``import`` / ``from ... import`` in a
module counts, at module level or inside a function (a function-level import is still a dependency, only a
later one). An edge goes to the named module: ``from sparrow.kernels import act`` to ``sparrow.kernels.act``
(a submodule), ``from sparrow.kernels import use_triton`` to ``sparrow.kernels`` (its ``__init__``). The
implicit import of a module's parent packages is not an edge (every module would then sit in a cycle through
``sparrow/__init__.py``), as import linters count it. Runnable as a script: prints each cycle found.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sparrow"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package_dir: Path | None = None) -> dict[str, set[str]]:
    """Module -> the sparrow modules it imports (module name -> set of module names), from every .py file."""
    package_dir = package_dir or ROOT / PACKAGE
    files = {_module_name(p, package_dir.parent): p for p in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_graph_sees_function_level_and_relative_imports(tmp_path):
    """The reader itself: a cycle closed only by a function-level import is found, a plain chain is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import f\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.b"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_no_import_cycle_in_sparrow():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    assert find_cycles(graph) == []


def test_kernels_do_not_import_layers():
    """kernels/ holds the torch twins the layers call on CPU, so no kernel module depends on a layer."""
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.startswith("sparrow.layers")) for m, ts in graph.items()
           if m.startswith("sparrow.kernels")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


if __name__ == "__main__":
    for cycle in find_cycles(import_graph()):
        print(" <-> ".join(cycle))

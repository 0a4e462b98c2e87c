"""The import graph of sparrow/: no module cycle (``docs/architecture.md``, "Packages and layers": kernels/ never
imports layers/), and at the package level no two-way dependency and no import up the declared layer order
(``LAYERS``).

The graph is read from the source with ``ast``, not by importing: every ``import`` / ``from ... import`` in a
module counts, at module level or inside a function (a function-level import is still a dependency, only a
later one), and so does one under ``if TYPE_CHECKING``. An edge goes to the named module: ``from sparrow.kernels
import act`` to ``sparrow.kernels.act`` (a submodule), ``from sparrow.kernels import use_triton`` to
``sparrow.kernels`` (its ``__init__``). The implicit import of a module's parent packages is not an edge (every
module would then sit in a cycle through ``sparrow/__init__.py``), as import linters count it. The package graph
merges the modules of each unit (``unit_of``). Runnable as a script: prints each module cycle and each package
edge that breaks the layering.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sparrow"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("switches", "devices", "cache", "structured_outputs", "outputs"),
    ("sampling_params", "tokenizer", "default_model"),
    ("kernels",),
    ("distributed",),
    ("config",),
    ("quant",),
    ("layers",),
    ("models", "kv_cache"),
    ("loader", "lora"),
    ("engine",),
    ("spec_decode",),
    ("llm", "__init__"),
    ("model_shapes", "random_gguf", "bench", "cli_support", "server"),
    ("cli_args", "cli", "__main__"),
)
"""sparrow's package layers, lowest first; a unit may import units of its own layer or below, never above, and
two units never import each other. Units are named relative to ``sparrow``: a subpackage (``kernels`` stands for
every module under sparrow/kernels/), a top-level module (``llm``), or ``__init__`` (the package itself, the
public API). Every unit must be listed; a new package or top-level module gets its place here. What each layer
is:

- errors; then the leaf modules (switches, devices, the file cache, the request and output types); then the
  modules that use them (sampling parameters, the tokenizer, the packaged default model);
- kernels: the Triton kernels and their torch twins (they never import layers: the layers call them);
- distributed: the process group, the Communicator every collective goes through, rank / world and shard
  arithmetic (the formats' loaders and the layers shard by it);
- config: the frozen config dataclasses, normalized from HF config.json or GGUF metadata;
- quant: the weight formats' method objects (the layers hold them, so quant never imports layers);
- layers: attention, linear, MoE, norms, logits, the per-layer LoRA buffers;
- models (built from layers) beside kv_cache (the paged pool the attention layers write);
- loader (builds a model from a checkpoint) beside lora (adapters read onto a built model's layers);
- engine: scheduler, block manager, model runner, the step plan and the speculator interface;
- spec_decode: the speculator, whose draft model runs on the engine's model runner;
- llm (``LLM``: loads the model, builds the engine and its speculator) and the package's public API;
- the front ends: model shapes (and their random GGUF blocks) and benchmarks, the CLI's shared helpers, the HTTP
  server; then the CLI (its parser and commands).
"""


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


def unit_of(module: str) -> str:
    """The package-level unit of a module: ``sparrow.<sub>`` for every module of a subpackage or a top-level
    module, ``sparrow`` for the package's own ``__init__``."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Unit -> {unit it imports: the (module, imported module) edges behind it}, edges inside a unit dropped."""
    packages: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(unit_of(module), {})
        for target in sorted(targets):
            if unit_of(target) != unit_of(module):
                edges.setdefault(unit_of(target), []).append((module, target))
    return packages


def layer_index(layers=LAYERS, package: str = PACKAGE) -> dict[str, int]:
    """Unit name (``sparrow.kernels``, ``sparrow`` for ``__init__``) -> its layer's index in ``layers``."""
    return {package if name == "__init__" else f"{package}.{name}": i
            for i, layer in enumerate(layers) for name in layer}


def layering_errors(packages, layers=LAYERS, package: str = PACKAGE) -> list[str]:
    """What breaks the layering, one line each: a unit missing from ``layers`` or listed twice, a two-way
    package dependency (either side's module edges named), an import of a higher layer."""
    names = [name for layer in layers for name in layer]
    index = layer_index(layers, package)
    errors = [f"{name!r} is listed twice in LAYERS" for name in sorted({n for n in names if names.count(n) > 1})]
    errors += [f"{unit} is in no layer of LAYERS" for unit in sorted(packages) if unit not in index]
    for unit, deps in sorted(packages.items()):
        for dep, edges in sorted(deps.items()):
            shown = ", ".join(f"{m} -> {t}" for m, t in edges[:3]) + (" ..." if len(edges) > 3 else "")
            if unit in packages.get(dep, {}) and unit < dep:
                back = packages[dep][unit]
                errors.append(f"two-way: {unit} <-> {dep} ({shown}; {', '.join(f'{m} -> {t}' for m, t in back[:3])})")
            if unit in index and dep in index and index[dep] > index[unit]:
                errors.append(f"upward: {unit} (layer {index[unit]}) imports {dep} (layer {index[dep]}): {shown}")
    return errors


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


def test_layering_reader(tmp_path):
    """The package check itself: a two-way dependency (closed by a function-level import), an upward edge and an
    undeclared unit are each reported; edges inside a unit are not."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from pkg.low import b\ndef f():\n    from pkg.high import c\n")
    (pkg / "low" / "b.py").write_text("")
    (pkg / "high" / "c.py").write_text("from pkg.low import a\n")
    (pkg / "top.py").write_text("import pkg.high.c\n")
    packages = package_graph(import_graph(pkg))
    assert packages["pkg.low"] == {"pkg.high": [("pkg.low.a", "pkg.high.c")]}
    errors = layering_errors(packages, layers=(("low",), ("high",)), package="pkg")
    assert [e.split(":")[0] for e in errors] == ["pkg is in no layer of LAYERS", "pkg.top is in no layer of LAYERS",
                                                 "two-way", "upward"]
    layers = (("__init__",), ("low", "high"), ("top",))
    assert [e.split(":")[0] for e in layering_errors(packages, layers=layers, package="pkg")] == ["two-way"]


def test_sparrow_packages_follow_the_layers():
    """No two-way package dependency, no import up ``LAYERS``, every unit in a layer (the message names the
    module edges behind each break)."""
    packages = package_graph(import_graph())
    assert len(packages) > 20  # the walk found the packages
    assert layering_errors(packages) == []
    assert find_cycles({u: set(deps) for u, deps in packages.items()}) == []  # so no longer package cycle either


def test_kernels_do_not_import_layers():
    """kernels/ holds the torch twins the layers call on CPU, so no kernel module depends on a layer."""
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.startswith("sparrow.layers")) for m, ts in graph.items()
           if m.startswith("sparrow.kernels")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


if __name__ == "__main__":
    for cycle in find_cycles(import_graph()):
        print(" <-> ".join(cycle))
    for error in layering_errors(package_graph(import_graph())):
        print(error)

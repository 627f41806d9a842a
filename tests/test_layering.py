"""The package's import graph: no circles, and no arrow from a lower layer to a higher one.

Every module under treeserve/ is parsed with `ast` (nothing is imported), and each
`import treeserve...` / `from treeserve... import ...` (absolute or relative) becomes an
arrow, at module level or inside a function alike: a deferred import is still a dependency.
Imports under `if TYPE_CHECKING:` are left out: they exist for annotations only and run
never, so they cannot form a circle at import time; they still must not point upward.
`from pkg import name` points at `pkg.name` when that is a module, else at `pkg`.

The layers, top to bottom (DESIGN.md's "Layers", docs/architecture.md); a module may import
its own layer (without circles) and any layer below it, never one above:

    cli          treeserve/cli.py, model_flags.py, __main__.py: the command line
    server       HTTP server, engine-core process
    eval         datasets, grading, metrics, reports, plots
    search       strategies, PRM adapters, score cache, traces
    runtime      several engines in one process and one memory budget
    api          treeserve/llm.py: the offline `LLM` over one engine
    engine       one model: requests, scheduler, model runner, sampler, the rank worker
    settings     treeserve/config.py (EngineConfig, SpeculativeConfig), device.py: checked
                 against the model's config and the devices before anything loads
    kv           paged KV memory
    models       model definitions, their config, loaders, the checkpoint's split over ranks
    layers       the building blocks models are written in
    distributed  process groups (the collectives layers call) and rank launchers (local, Ray);
                 the loop a rank runs comes from the engine as a function, so nothing here
                 imports the layers above
    kernels      C and Triton kernels
    contracts    data-only leaves every layer may use: treeserve/__init__.py (whose exports
                 load lazily by name), outputs.py, sampling_params.py, assets/
"""

from __future__ import annotations

import ast
from pathlib import Path

import treeserve

PACKAGE = Path(treeserve.__file__).parent

# top to bottom; a module belongs to its longest matching package or module name ("treeserve", the
# root package, matches itself only)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("treeserve.cli", "treeserve.model_flags", "treeserve.__main__")),
    ("server", ("treeserve.server",)),
    ("eval", ("treeserve.eval",)),
    ("search", ("treeserve.search",)),
    ("runtime", ("treeserve.runtime",)),
    ("api", ("treeserve.llm",)),
    ("engine", ("treeserve.engine",)),
    ("settings", ("treeserve.config", "treeserve.device")),
    ("kv", ("treeserve.kv",)),
    ("models", ("treeserve.models",)),
    ("layers", ("treeserve.layers",)),
    ("distributed", ("treeserve.distributed",)),
    ("kernels", ("treeserve.kernels",)),
    ("contracts", ("treeserve", "treeserve.outputs", "treeserve.sampling_params", "treeserve.assets")),
]


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package` (a package is its __init__)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(files: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import} (treeserve modules only)."""

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target.split(".")[0] != "treeserve":
                    continue
                found = owner(target)
                if found is not None and found != module:
                    edges.setdefault(found, node.lineno)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]] | dict[str, list[str]]) -> list[str] | None:
    """A circle of imports as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def layer_of(module: str) -> int:
    """The index of `module`'s layer in LAYERS (0 is the top)."""
    best, index = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module.startswith(prefix + ".") and prefix != "treeserve"
            if (module == prefix or inside) and len(prefix) > best:
                best, index = len(prefix), i
    assert index is not None, f"{module} is in no layer: add it to LAYERS"
    return index


def upward_imports(graph: dict[str, dict[str, int]], files: dict[str, Path]) -> list[str]:
    bad = []
    for module, edges in graph.items():
        for target, line in edges.items():
            low, high = layer_of(module), layer_of(target)
            if high < low:
                where = f"{files[module].relative_to(PACKAGE.parent)}:{line}"
                bad.append(f"{where}: {module} ({LAYERS[low][0]}) imports {target} ({LAYERS[high][0]})")
    return sorted(bad)


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": ["c"], "c": [], "d": ["a", "c"]}) is None


def test_the_graph_sees_deferred_and_relative_imports(tmp_path: Path) -> None:
    package = tmp_path / "treeserve"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "top.py").write_text("def f():\n    from treeserve.sub import low\n")
    (package / "sub" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import other\nif TYPE_CHECKING:\n    from treeserve import top\n"
    )
    (package / "sub" / "other.py").write_text("from ..top import f\n")
    graph = import_graph(module_files(package))
    assert graph["treeserve.top"] == {"treeserve.sub.low": 2}
    assert graph["treeserve.sub.low"] == {"treeserve.sub.other": 2}  # the TYPE_CHECKING import is left out
    assert graph["treeserve.sub.other"] == {"treeserve.top": 1}
    assert find_cycle(graph) == ["treeserve.sub.low", "treeserve.sub.other", "treeserve.top", "treeserve.sub.low"]


def test_no_import_circles() -> None:
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_has_a_layer() -> None:
    for module in module_files():
        layer_of(module)


def test_no_import_points_up_a_layer() -> None:
    files = module_files()
    bad = upward_imports(import_graph(files), files)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_type_checking_imports_do_not_point_up_either() -> None:
    """Annotations name only their own layer and the layers below it too."""
    files = module_files()
    bad = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and _type_checking_only(node):
                for inner in node.body:
                    if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("treeserve"):
                        target = inner.module
                        while target not in files:
                            target = target.rpartition(".")[0]
                        if layer_of(target) < layer_of(module):
                            bad.append(f"{module}:{inner.lineno} imports {inner.module} for annotations")
    assert not bad, "\n".join(bad)

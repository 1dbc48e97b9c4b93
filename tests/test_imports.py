"""The package's imports form layers: no module imports, at any depth or inside a function, one
that imports it back, and the modules at the bottom import nothing of the runtime above them."""

from __future__ import annotations

import ast
from pathlib import Path

import kdarun

PACKAGE = Path(kdarun.__file__).resolve().parent
# Bottom modules and all they may import from the package: errors and dtypes import nothing of
# it, config only the error, and the backend contract knows no implementation.
BOTTOM = {"errors": set(), "dtypes": set(), "config": {"errors"},
          "backend": {"errors"}}


def package_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the package modules it imports (`from .x import y`, `from . import x`,
    `import kdarun.x`, at any depth of the file); `__init__` for names taken from the package."""
    modules = {p.stem for p in root.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level == 1 or
                                                     (node.module or "").startswith("kdarun")):
                base = node.module.removeprefix("kdarun").lstrip(".") if node.module else ""
                if base:
                    deps.add(base.split(".")[0])
                else:  # from . import a, b: submodules, or names of the package itself
                    deps |= {a.name if a.name in modules else "__init__" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names
                         if a.name.startswith("kdarun.")}
        graph[path.stem] = deps - {path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = package_imports()
    graph.pop("__init__")  # it imports the public names of every module and nobody imports it
    assert not any("__init__" in deps for deps in graph.values()), \
        {m: d for m, d in graph.items() if "__init__" in d}
    assert cycles(graph) == []


def test_bottom_modules_import_nothing_above_them():
    graph = package_imports()
    for module, allowed in BOTTOM.items():
        assert graph[module] <= allowed, (module, graph[module] - allowed)


def test_a_cycle_is_found(tmp_path):
    """The walk sees imports inside functions and `from . import`: a module importing, in a
    function, one that imports it back is a cycle."""
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "c.py").write_text("from .a import y\n")
    assert cycles(package_imports(tmp_path)) == [["a", "b"]]

"""The product's import structure: no module under hyla/ imports the benchmarks (hyla.bench), the
figures (hyla.viz), scripts/ or tests/, except the `hyla` command's own `bench` and `plot` entry points;
and no import cycle among hyla/ modules, counting imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hyla"
FRONT_ENDS = {"hyla.cli"}  # `hyla bench` / `hyla plot` dispatch to them


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The hyla modules `name` imports anywhere in its file (module level or inside functions);
    `from pkg import x` counts as pkg.x when that is a module, else pkg."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found |= {known(f"{base}.{a.name}") for a in node.names}
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(known(node.args[0].value))
    return {m for m in found if m and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_the_product_never_imports_benchmarks_figures_or_scripts():
    bad = []
    for name, deps in _graph().items():
        if name.startswith(("hyla.bench", "hyla.viz")) or name in FRONT_ENDS:
            continue
        bad += [f"{name} -> {d}" for d in deps if d.startswith(("hyla.bench", "hyla.viz"))]
    assert not bad, bad
    scripts = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            scripts += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("scripts", "tests")]
    assert not scripts, scripts


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
    assert not cycles, cycles


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The checker itself: a function-level import is an edge (a cycle hidden in a function body
    is still a cycle)."""
    mods = {"hyla.a": tmp_path / "a.py", "hyla.b": tmp_path / "b.py"}
    mods["hyla.a"].write_text("def f():\n    from hyla import b\n")
    mods["hyla.b"].write_text("from hyla.a import f\n")
    assert _imports("hyla.a", mods["hyla.a"], mods) == {"hyla.b"}
    assert _imports("hyla.b", mods["hyla.b"], mods) == {"hyla.a"}

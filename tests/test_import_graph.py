"""The import contract of ``runtime/`` and ``cache_policy/``: no import circle, and no function-level
import of a project module except where the allowlist below says why.

Function-level imports hide circles from the interpreter (the circle still exists: two modules that each
need the other can only be loaded in one order, and a refactor that moves the import to the top breaks
at import time). So the graph here counts every import, wherever it sits in the module, and a module's
function-level imports of project modules must each be justified.

The walker reads the source with ``ast`` (nothing is imported), so it sees the code as written:
- ``import a.b.c`` and ``from a.b import c`` (``c`` a submodule) import ``a.b.c``; ``from a.b import name``
  (``name`` not a submodule) imports ``a.b`` - its ``__init__``;
- importing a module also runs the ``__init__`` of each package above it, so those count too - except the
  packages above the importing module itself: they are already initialised when it runs (a package's
  ``__init__`` importing its own submodules is fine while they do not import the package back);
- imports under ``if TYPE_CHECKING:`` never run, so they make no edge;
- ``importlib.import_module`` is not read (runtime/model/arch loads its architecture modules by name; they
  import only their package, so that registry closes no circle).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "cache_policy")

# Function-level imports of project modules that stay, "importer -> imported": why each one is needed.
# Keep it short: a lazy import of a project module is a circle waiting to be found.
ALLOWED_LAZY: dict = {
    "runtime.cli -> runtime.cli_model":
        "the commands that load a model import torch; replay and trace start without it (tests/runtime/test_cli.py)",
    "runtime.cli_args -> runtime.quant":
        "convert --quantize's choices come from the format registry, which imports torch; replay's parser is this one",
}


@dataclass(frozen=True)
class Import:
    importer: str      # module name, e.g. "runtime.store.store"
    target: str        # the project module it imports
    line: int
    lazy: bool         # inside a function (runs when the function is called, not at import)
    implicit: bool = False   # a package whose __init__ the import runs on the way to ``target``-s submodule


def _modules(root: Path, packages) -> dict:
    """{module name: path} of every .py file under ``root/<package>`` (``__init__`` names its package)."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.Module):
    """(node, lazy) for every import statement that can run: lazy when inside a function."""
    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:          # the ``else`` of ``if TYPE_CHECKING`` does run
                    yield from visit_stmt(sub, lazy)
                continue
            yield from visit_stmt(child, lazy)

    def visit_stmt(child, lazy):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy
        yield from visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    yield from visit(tree, False)


def imports(root, packages=PACKAGES) -> list:
    """Every import of a project module by a project module under ``root``, as ``Import``s."""
    root = Path(root)
    mods = _modules(root, packages)
    out = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]     # the package relative imports start in
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, lazy in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                    if node.level - 1 > len(here):
                        raise ValueError(f"{path}:{node.lineno}: relative import beyond the top package")
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                # ``from pkg import sub`` imports the submodule; a plain name comes from pkg's __init__.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                run = _with_packages(t, name, mods)
                for mod in run:
                    out.append(Import(name, mod, node.lineno, lazy, implicit=mod != run[-1]))
    return out


def _with_packages(target: str, importer: str, mods: dict) -> list:
    """The project modules that importing ``target`` runs: it (or its nearest project ancestor: ``import
    a.b.Name`` style attribute paths) and every package above it that is not above ``importer``."""
    parts = target.split(".")
    if parts[0] not in {m.split(".")[0] for m in mods}:
        return []
    while parts and ".".join(parts) not in mods:
        parts.pop()
    mine = importer.split(".")
    run = []
    for i in range(1, len(parts) + 1):
        mod = ".".join(parts[:i])
        if mod in mods and mod != importer and not (i < len(parts) and mine[:i] == parts[:i]):
            run.append(mod)
    return run


def graph(root, packages=PACKAGES) -> dict:
    """{module: {imported module: first line}}."""
    g: dict = {m: {} for m in _modules(Path(root), packages)}
    for imp in imports(root, packages):
        g[imp.importer].setdefault(imp.target, imp.line)
    return g


def cycles(g: dict) -> list:
    """The strongly connected components with more than one module (or a module importing itself), each
    as a sorted list: every import circle lies inside one of them."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def strong(v):                       # Tarjan's algorithm, iterative (the graph can be deep)
        work = [(v, iter(sorted(g[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1 or node in g[node]:
                        comps.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return sorted(comps)


def a_circle(g: dict, comp: list) -> list:
    """One concrete circle through the component's first module: [m0, m1, ..., m0] (shortest, by BFS)."""
    start, inside = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 or v != start else [start, start]
                if w in inside and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def describe(g: dict, comps: list) -> str:
    lines = []
    for comp in comps:
        circle = a_circle(g, comp)
        steps = " -> ".join(f"{a} (line {g[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"
        lines.append(f"{len(comp)} modules in a circle: {', '.join(comp)}\n    e.g. {steps}")
    return "\n".join(lines)


# -- the contract -------------------------------------------------------------------------------------
def test_no_import_circle():
    g = graph(ROOT)
    comps = cycles(g)
    assert not comps, "import circles in runtime/ and cache_policy/:\n" + describe(g, comps)


def test_function_level_project_imports_are_allowlisted():
    lazy = sorted({(i.importer, i.target, i.line) for i in imports(ROOT) if i.lazy and not i.implicit})
    unexplained = [f"{a}:{line} imports {b} inside a function" for a, b, line in lazy
                   if f"{a} -> {b}" not in ALLOWED_LAZY]
    assert not unexplained, ("function-level imports of project modules (move them to the top, or add them to "
                             "ALLOWED_LAZY with the reason):\n" + "\n".join(unexplained))
    used = {f"{a} -> {b}" for a, b, _ in lazy}
    stale = sorted(set(ALLOWED_LAZY) - used)
    assert not stale, f"ALLOWED_LAZY names imports that are gone: {stale}"


# -- the walker finds what it should ------------------------------------------------------------------
def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_walker_reports_a_circle_through_a_function_level_import(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import f\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from ..a import g\n",      # relative, two levels, lazy
        "pkg/b.py": "from pkg.sub import b\n",                      # `from pkg import sub`-style submodule
        "pkg/c.py": "import os\nimport numpy\n",
    })
    g = graph(tmp_path, ("pkg",))
    assert g["pkg.a"] == {"pkg.b": 1}
    assert g["pkg.b"] == {"pkg.sub": 1, "pkg.sub.b": 1}
    assert g["pkg.sub.b"] == {"pkg.a": 2}
    assert g["pkg.c"] == {}
    comps = cycles(g)
    assert comps == [["pkg.a", "pkg.b", "pkg.sub.b"]]
    msg = describe(g, comps)
    assert "pkg.a (line 1) -> pkg.b (line 1) -> pkg.sub.b (line 2) -> pkg.a" in msg
    lazy = [i for i in imports(tmp_path, ("pkg",)) if i.lazy]
    assert [(i.importer, i.target) for i in lazy] == [("pkg.sub.b", "pkg.a")]


def test_walker_package_init_rules(tmp_path):
    _write(tmp_path, {
        # an __init__ re-exporting its submodules: fine while they do not import the package back
        "pkg/__init__.py": "from .a import A\nfrom . import b\n",
        "pkg/a.py": "A = 1\n",
        "pkg/b.py": "from .a import A\n",
        # a package importing another package's submodule runs that package's __init__ too
        "pkg/q/__init__.py": "from .r import R\n",
        "pkg/q/r.py": "R = 1\nif False:\n    pass\n",
        "pkg/s.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .q.r import R\nelse:\n    from .a import A\n",
    })
    g = graph(tmp_path, ("pkg",))
    assert g["pkg"] == {"pkg.a": 1, "pkg.b": 2}
    assert g["pkg.b"] == {"pkg.a": 1}
    assert g["pkg.s"] == {"pkg.a": 5}            # the TYPE_CHECKING import never runs
    assert cycles(g) == []
    # ... and a submodule importing a name from its package's __init__ closes a circle
    _write(tmp_path, {"pkg/a.py": "from . import b\nA = 1\n", "pkg/b.py": "from pkg import A\n"})
    g = graph(tmp_path, ("pkg",))
    assert g["pkg.b"] == {"pkg": 1}
    assert cycles(g) == [["pkg", "pkg.a", "pkg.b"]]
    # importing pkg.q.r from outside pkg.q runs pkg/q/__init__ as well
    _write(tmp_path, {"pkg/q/r.py": "from ..s import S\n", "pkg/s.py": "S = 1\n", "pkg/t.py": "import pkg.q.r\n"})
    g = graph(tmp_path, ("pkg",))
    assert g["pkg.t"] == {"pkg.q": 1, "pkg.q.r": 1}
    assert g["pkg.q.r"] == {"pkg.s": 1}


if __name__ == "__main__":      # python tests/test_import_graph.py: the circles and lazy imports, for work on them
    g = graph(ROOT)
    print(describe(g, cycles(g)) or "no circles")
    for i in sorted({(i.importer, i.line, i.target) for i in imports(ROOT) if i.lazy and not i.implicit}):
        print(f"lazy: {i[0]}:{i[1]} -> {i[2]}")


"""The size contract of ``runtime/``, ``cache_policy/`` and ``bench/`` (issue 28): no ``.py`` file over 600
lines and no function or method over 80 lines, nested ones included.

A function's length is ``end_lineno - lineno + 1`` of its ``ast`` node: from the ``def`` line (decorators
not counted) to its last line, docstring, comments and blank lines inside it included. A file's length is
its number of lines. The source is read with ``ast``, nothing is imported. On failure the message lists
every offender, one per line, as ``path:line name length`` (paths relative to the repository root).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("runtime", "cache_policy", "bench")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def python_files(root: Path, trees=TREES) -> "list[Path]":
    """Every ``.py`` file under ``root/<tree>``, sorted; hidden folders and ``__pycache__`` left out."""
    out = []
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            rel = path.relative_to(root).parts
            if not any(p.startswith(".") or p == "__pycache__" for p in rel[:-1]):
                out.append(path)
    return out


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method in ``tree``, nested ones too (``Class.method``,
    ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def long_files(root: Path, trees=TREES, limit: int = MAX_FILE_LINES) -> "list[str]":
    """``path:1 <file> length`` of every file over ``limit`` lines."""
    out = []
    for path in python_files(root, trees):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root).as_posix()}:1 <file> {n}")
    return out


def long_functions(root: Path, trees=TREES, limit: int = MAX_FUNCTION_LINES) -> "list[str]":
    """``path:line name length`` of every function or method over ``limit`` lines."""
    out = []
    for path in python_files(root, trees):
        rel = path.relative_to(root).as_posix()
        for name, node in _functions(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append(f"{rel}:{node.lineno} {name} {n}")
    return out


def _report(what: str, offenders: "list[str]") -> str:
    return f"{len(offenders)} {what}:\n" + "\n".join(offenders)


def test_no_file_over_600_lines():
    offenders = long_files(ROOT)
    assert not offenders, _report(f"files over {MAX_FILE_LINES} lines (path:1 <file> lines)", offenders)


def test_no_function_over_80_lines():
    offenders = long_functions(ROOT)
    assert not offenders, _report(f"functions over {MAX_FUNCTION_LINES} lines (path:line name lines)", offenders)


def _function(name: str, lines: int, indent: str = "") -> str:
    """Source of a function ``lines`` lines long (its ``def`` line included)."""
    body = [f"{indent}    x = {i}" for i in range(lines - 2)]
    return "\n".join([f"{indent}def {name}():", *body, f"{indent}    return x"]) + "\n"


def test_checks_report_what_is_over_the_limits(tmp_path):
    (tmp_path / "runtime" / "pkg").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "runtime" / "pkg" / "big.py").write_text("import os\n\n\n" + _function("too_long", 81))
    (tmp_path / "bench" / "fits.py").write_text(_function("just_fits", 80))
    (tmp_path / "runtime" / "nested.py").write_text(
        "class Box:\n    @staticmethod\n" + _function("method", 81, "    ")
        + "\n\nasync def outer():\n" + _function("inner", 81, "    ") + "    return inner\n")
    (tmp_path / "cache_policy").mkdir()
    (tmp_path / "cache_policy" / "long.py").write_text("x = 1\n" * 601)
    (tmp_path / "cache_policy" / "ok.py").write_text("x = 1\n" * 600)
    (tmp_path / "runtime" / "__pycache__").mkdir()
    (tmp_path / "runtime" / "__pycache__" / "skipped.py").write_text("x = 1\n" * 700 + _function("skipped", 90))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "not_walked.py").write_text("x = 1\n" * 700 + _function("not_walked", 90))

    assert long_functions(tmp_path) == ["runtime/nested.py:3 Box.method 81", "runtime/nested.py:86 outer 83",
                                        "runtime/nested.py:87 outer.inner 81", "runtime/pkg/big.py:4 too_long 81"]
    assert long_files(tmp_path) == ["cache_policy/long.py:1 <file> 601"]
    # The limits are parameters: at 81 the 81-line functions fit, at 79 the 80-line one is reported.
    assert long_functions(tmp_path, limit=81) == ["runtime/nested.py:86 outer 83"]
    assert "bench/fits.py:1 just_fits 80" in long_functions(tmp_path, limit=79)
    assert long_files(tmp_path, limit=601) == []

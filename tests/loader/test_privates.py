"""A package's privates stay inside it (docs/ARCHITECTURE.md; issue 23.3): no module reads or writes an
underscore attribute that only another stallfree package defines.

Before, ``loader/worker/shards.py`` drove ``ShardedDataset``'s ``_open_reader``, ``_readers``,
``_open_lock``, ``_setup`` and ``_pid``; concurrency over shards is now the shards package's own
(``ShardedDataset.warm`` / ``get_many(executor=)``). Static and conservative: an attribute
counts as a package's private when one of its modules defines it (``self._x = ...``, a
``def _x``, a module- or class-level ``_x = ...``) and the accessing package defines no attribute of that
name itself; ``self`` / ``cls`` accesses are always a class's own.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "stallfree"


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else "."


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(value: ast.expr) -> bool:
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


def _defined(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for el in ast.walk(t):
                if isinstance(el, ast.Attribute) and _private(el.attr) and _own(el.value):
                    names.add(el.attr)
                elif isinstance(el, ast.Name) and _private(el.id):
                    names.add(el.id)
    return names


def _accesses(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if _own(node.value):
                continue
            out.append((node.lineno, node.attr))
    return out


def cross_package_privates() -> list[str]:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))}
    defined: dict[str, set[str]] = defaultdict(set)
    for p, tree in trees.items():
        defined[_package(p)] |= _defined(tree)
    bad = []
    for p, tree in trees.items():
        pkg = _package(p)
        for line, name in _accesses(tree):
            if name in defined[pkg]:
                continue
            owners = sorted(q for q, names in defined.items() if q != pkg and name in names)
            if owners:
                bad.append(f"{p.relative_to(ROOT.parent)}:{line}: .{name} (private of {', '.join(owners)})")
    return bad


def test_no_package_touches_a_private_of_another():
    bad = cross_package_privates()
    assert bad == [], "\n".join(bad)


def test_the_finder_finds_cross_package_privates(tmp_path, monkeypatch):
    (tmp_path / "shards").mkdir()
    (tmp_path / "loader").mkdir()
    (tmp_path / "shards" / "open.py").write_text(
        "class D:\n    def __init__(self):\n        self._readers = []\n"
    )
    (tmp_path / "loader" / "io.py").write_text("def f(ds):\n    return ds._readers\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [b.split(": ", 1)[1] for b in cross_package_privates()] == ["._readers (private of shards)"]

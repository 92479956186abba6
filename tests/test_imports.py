"""The package's import graph: no cycles, and the layering docs/ARCHITECTURE.md states.

Every ``import`` / ``from ... import`` statement in stallfree/ counts, wherever it is written
(module level, inside functions, under ``if TYPE_CHECKING:``): a function-level import hides a
cycle from the interpreter at import time but not from the design. Relative imports are resolved
against the importing module's package. Dynamic ``importlib.import_module(name)`` calls are not
seen (the lazy public API in ``stallfree/__init__.py`` and the CLI's subcommand table use them).
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "stallfree"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


@dataclass(frozen=True)
class Edge:
    """Where a module first imports another: the line, and module level, in a function, or only
    under ``if TYPE_CHECKING:``."""

    line: int
    where: str

    def __str__(self) -> str:
        return f"line {self.line}, {self.where}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, where: str = "module level") -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement in ``tree`` with where it sits (functions and classes included)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, where
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _statements(node, "in a function")
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), "TYPE_CHECKING only")
            for child in node.orelse:
                yield from _statements(ast.Module(body=[child], type_ignores=[]), where)
        else:
            yield from _statements(node, where)


def _imported(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int, str]]:
    """(module imported, line, where) for every import statement in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node, where in _statements(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, where
            continue
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        plain_names = False
        for alias in node.names:
            if f"{base}.{alias.name}" in known:  # ``from pkg import submodule``
                yield f"{base}.{alias.name}", node.lineno, where
            else:
                plain_names = True
        if plain_names:
            yield base, node.lineno, where


@functools.cache
def import_graph(root: Path = ROOT) -> dict[str, dict[str, Edge]]:
    """module -> {our module it imports: where first}; only edges between stallfree modules.
    Parsed once per process and root (each check here reads the same graph; the tests only read it)."""
    modules = _modules(root)
    known = set(modules)
    graph: dict[str, dict[str, Edge]] = {}
    for name, path in modules.items():
        edges: dict[str, Edge] = {}
        for target, line, where in _imported(name, path, known):
            if target in known and target != name:
                edges.setdefault(target, Edge(line, where))
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """One cycle path ``[a, b, ..., a]`` per strongly connected component of more than one module
    (Tarjan's algorithm, iterative), sorted so the output is stable."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return sorted(_cycle_in(graph, comp) for comp in components)


def _cycle_in(graph: dict[str, dict[str, Edge]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def _describe(graph: dict[str, dict[str, Edge]], cycle: list[str]) -> str:
    hops = [f"{a} ({graph[a][b]}) -> {b}" for a, b in itertools.pairwise(cycle)]
    return "\n    ".join(hops)


# -- the checker checks -------------------------------------------------------------------------
def test_cycle_finder_reports_the_path_and_ignores_dags():
    dag = {"a": {"b": 1, "c": 1}, "b": {"c": 2}, "c": {}}
    assert find_cycles(dag) == []
    loop = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 3}, "d": {}, "x": {"y": 1}, "y": {"x": 2}}
    assert find_cycles(loop) == [["a", "b", "c", "a"], ["x", "y", "x"]]


def test_relative_and_function_level_imports_are_resolved(tmp_path):
    pkg = tmp_path / PACKAGE / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .b import thing\n    from .. import other\n")
    (pkg / "b.py").write_text("import stallfree.sub.a\nthing = 1\n")
    (tmp_path / PACKAGE / "other.py").write_text("from .sub.a import f\n")
    (tmp_path / PACKAGE / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stallfree.sub import b\n"
    )
    graph = import_graph(tmp_path)
    assert graph["stallfree.sub"] == {"stallfree.sub.a": Edge(1, "module level")}
    assert graph["stallfree.sub.a"] == {
        "stallfree.sub.b": Edge(2, "in a function"),
        "stallfree.other": Edge(3, "in a function"),
    }
    assert graph["stallfree.sub.b"] == {"stallfree.sub.a": Edge(1, "module level")}
    assert graph["stallfree.other"] == {"stallfree.sub.a": Edge(1, "module level")}
    assert graph["stallfree.typed"] == {"stallfree.sub.b": Edge(3, "TYPE_CHECKING only")}
    # one component {a, b, other}; its shortest cycle through the first module
    assert find_cycles(graph) == [["stallfree.other", "stallfree.sub.a", "stallfree.other"]]


# -- the package's rules ---------------------------------------------------------------------------
def test_no_import_cycle_between_modules():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(f"  cycle:\n    {_describe(graph, c)}" for c in cycles)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(
    graph: dict[str, dict[str, Edge]],
    source: str,
    allowed: tuple[str, ...] | None = None,
    forbidden: tuple[str, ...] = (),
) -> list[str]:
    """Imports from modules of package ``source`` outside ``allowed`` (when given) or inside
    ``forbidden``, as ``module (line N, where) imports target``."""
    out = []
    for module, edges in sorted(graph.items()):
        if not _within(module, source):
            continue
        for target, edge in sorted(edges.items()):
            outside = allowed is not None and not any(_within(target, a) for a in allowed)
            if outside or any(_within(target, f) for f in forbidden):
                out.append(f"{module} ({edge}) imports {target}")
    return out


def test_subpackages_never_import_the_cli():
    graph = import_graph()
    subpackages = [m for m, p in _modules(ROOT).items() if p.name == "__init__.py" and m.count(".") == 1]
    assert "stallfree.cli" in subpackages and "stallfree.loader" in subpackages
    bad = [
        line
        for sub in subpackages
        if sub != "stallfree.cli"
        for line in _violations(graph, sub, forbidden=("stallfree.cli",))
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source, allowed",
    [
        ("stallfree.errors", ()),
        ("stallfree.storage", ("stallfree.storage", "stallfree.errors")),
        ("stallfree.shards", ("stallfree.shards", "stallfree.storage", "stallfree.errors")),
        (
            "stallfree.cache",
            (
                "stallfree.cache",
                "stallfree.shards",
                "stallfree.storage",
                "stallfree.errors",
                "stallfree.extras",
            ),
        ),
    ],
)
def test_layering(source, allowed):
    bad = _violations(import_graph(), source, allowed)
    assert not bad, f"{source} may import only {allowed}:\n" + "\n".join(bad)


_FORMAT_FOLDERS = ("stallfree.shards.tar", "stallfree.shards.arrow")


@pytest.mark.parametrize(
    "source, forbidden",
    [
        ("stallfree.shards.tar", ("stallfree.shards.arrow",)),
        ("stallfree.shards.arrow", ("stallfree.shards.tar",)),
        # the generic layer asks a format through the registry (formats.get_format), never by import
        ("stallfree.shards.manifest", _FORMAT_FOLDERS),
        ("stallfree.shards.formats", _FORMAT_FOLDERS),
        ("stallfree.shards.verify", _FORMAT_FOLDERS),
        ("stallfree.shards.open", _FORMAT_FOLDERS),
        ("stallfree.shards.writer", _FORMAT_FOLDERS),
    ],
)
def test_formats_stay_in_their_folders(source, forbidden):
    """A format is one folder plus one registry line: the format folders never import each other
    (what they share, like key and field naming rules, is in ``shards/naming.py``), and the
    dataset layer reaches a format only through ``formats.py``."""
    bad = _violations(import_graph(), source, forbidden=forbidden)
    assert not bad, f"{source} must not import {forbidden}:\n" + "\n".join(bad)


_TORCH_PRIVATE = ("torch._", "torch.utils.data._", "torch.utils.data.dataloader._")
_COMPAT = "stallfree.loader._torch_compat"
# private attributes of torch objects the loader needs (storages, loaders, iterators, worker info)
_TORCH_PRIVATE_ATTRS = {
    "_new_shared",
    "_share_fd_cpu_",
    "_worker_info",
    "_generate_state",
    "_auto_collation",
    "_index_sampler",
    "_shutdown_workers",
    "_timeout",
    "_utils",
    "_iterator",
}


def _string_probe(node: ast.AST) -> str | None:
    """The name in ``getattr(obj, "name", ...)`` / ``hasattr(obj, "name")``, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def test_torch_internals_are_touched_only_by_the_compat_module():
    """Private torch modules are imported, and private names of torch.utils.data read, only in
    stallfree/loader/_torch_compat.py (each use commented there, with a fallback)."""
    offenders = []
    for module, path in _modules(ROOT).items():
        if module == _COMPAT:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and node.attr in _TORCH_PRIVATE_ATTRS:
                names = [f"torch._ (private attribute .{node.attr})"]
            elif _string_probe(node) in _TORCH_PRIVATE_ATTRS:  # getattr(loader, "_iterator", None)
                names = [f"torch._ (private attribute {_string_probe(node)!r} by name)"]
            for name in names:
                if name.startswith(_TORCH_PRIVATE):
                    offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name}")
    assert offenders == []

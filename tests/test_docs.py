"""docs/ARCHITECTURE.md names only things that exist (issue 23 item 7): every file path in
backticks is a file or directory of this repository, and every backticked ``symbol``,
``module.symbol`` or ``Class.attribute`` is defined in ``stallfree/`` (or, for fixtures the
document points at, in ``tests/``).

The check is static (the package's ASTs, nothing imported), so it runs in well under a second. It
catches renames and removals; whether a sentence about a file is still true is for review.
Names that are not ours (``os.environ``, ``pread``, torch's) are listed in ``EXTERNAL``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stallfree"
DOCS = [ROOT / "docs" / "ARCHITECTURE.md"]
# Where only repository paths are checked (their other backticked text is mostly values and code).
PATH_DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "examples").glob("*.md")),
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p not in DOCS),
]

SPAN = re.compile(r"`([^`\n]+)`")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^{IDENT}(\.{IDENT})*$")
CALL = re.compile(rf"^(?P<name>{IDENT}(\.{IDENT})*)\(.*\)$")
KEYWORD = re.compile(rf"^(?P<name>{IDENT})=.*$")
FILE_SUFFIXES = (".py", ".c", ".md", ".sh", ".toml", ".txt")
# Not ours: the standard library, torch and tools the document mentions by name.
EXTERNAL_ROOTS = {
    "os",
    "gc",
    "weakref",
    "np",
    "numpy",
    "torch",
    "logging",
    "pyarrow",
    "fsspec",
    "lmdb",
    "redis",
}
EXTERNAL = {
    "pread",
    "pwrite",
    "fork",
    "print",
    "torchrun",
    "IterableDataset",
    "RawArray",
    "TYPE_CHECKING",
    "save_to_disk",  # Hugging Face datasets' method
}
ENV_VAR = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$")  # GLOO_SOCKET_IFNAME: not a name of ours
DATA_FILE = re.compile(r"^[\w-]+\.(json|jsonl|bin|idx|tar|arrow|parquet|png|jpg)$")  # index.json: a file name
# manifest.shards.bin: a file name too; not for .tar/.arrow, where shards.tar is a module of ours
DOTTED_DATA_FILE = re.compile(r"^[\w-]+(\.[\w-]+)+\.(json|jsonl|bin|idx|parquet|png|jpg)$")


@dataclass
class Index:
    """What ``stallfree/`` defines: per module its top-level names, per class its attributes,
    and every name defined or spelled as a string anywhere (mode names, stage names, ...)."""

    modules: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # "shm", "loader.shm", ...
    classes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    names: set[str] = field(default_factory=set)


def _target_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _target_names(elt)]
    return []


def _defined(node: ast.stmt) -> list[str]:
    """The names a top-level statement defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n for t in node.targets for n in _target_names(t)]
    if isinstance(node, ast.AnnAssign):
        return _target_names(node.target)
    return []


def build_index() -> Index:
    index = Index()
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        if path.is_relative_to(ROOT / "tests"):  # fixtures and helpers the document points at
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            index.names.update(n for node in tree.body for n in _defined(node))
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"] or ["stallfree"]
        keys = {".".join(parts[i:]) for i in range(len(parts))} | {"stallfree." + ".".join(parts)}
        top: set[str] = set()
        for node in tree.body:
            top.update(_defined(node))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top.update((a.asname or a.name).split(".")[0] for a in node.names)
        if path.name == "__init__.py":  # lazy re-exports: the keys of _EXPORTS
            top.update(
                c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
        for key in keys:
            index.modules[key] |= top
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                attrs = index.classes[node.name]
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        attrs.add(sub.name)
                    elif isinstance(sub, ast.Assign):
                        for target in sub.targets:
                            attrs.update(_target_names(target))
                    elif isinstance(sub, ast.AnnAssign):
                        attrs.update(_target_names(sub.target))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                index.names.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                index.names.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    index.names.update(_target_names(target))
            elif isinstance(node, ast.keyword) and node.arg:
                index.names.add(node.arg)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(IDENT, node.value)
            ):
                index.names.add(node.value)
    return index


def is_path(span: str) -> bool:
    return (
        " " not in span and not span.startswith((".", "-")) and ("/" in span or span.endswith(FILE_SUFFIXES))
    )


def is_repo_path(span: str) -> bool:
    """The narrower test for prose docs: a plain relative path (no URL, glob, quote or call) that
    ends in a source suffix or names a directory (``benchmarks/``)."""
    return (
        len(span) > 1
        and re.fullmatch(r"[\w][\w./-]*", span) is not None
        and (span.endswith(FILE_SUFFIXES) or span.endswith("/"))
    )


def path_exists(span: str) -> bool:
    """A path relative to the repository or to ``stallfree/``; a bare file name anywhere in it."""
    rel = span.rstrip("/")
    if (ROOT / rel).exists() or (PACKAGE / rel).exists():
        return True
    if "/" not in rel:
        return rel in _repo_names()
    return False


@functools.cache
def _repo_names() -> frozenset[str]:
    """Every file and folder name in the repository, outside .git and the virtual environments
    (walked once: a glob of the whole tree per span walked .venv each time)."""
    names: set[str] = set()
    for _, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".venv", ".git"))]
        names.update(dirs)
        names.update(files)
    return frozenset(names)


def symbol_problem(span: str, index: Index) -> str | None:
    """None when ``span`` names something that exists (or is not a name at all), else why not."""
    m = CALL.match(span) or KEYWORD.match(span)
    name = m.group("name") if m else span
    if not DOTTED.match(name):
        return None  # an expression, a value, a command line: not a name
    parts = name.split(".")
    if parts[0] in EXTERNAL_ROOTS or name in EXTERNAL or hasattr(builtins, name) or len(name) == 1:
        return None
    if (
        DATA_FILE.match(span)
        or DOTTED_DATA_FILE.match(span)
        or (ENV_VAR.match(name) and name not in index.names)
    ):
        return None
    if len(parts) == 1:
        known = name in index.names or name in index.classes or name in index.modules
        return None if known else f"`{span}`: no {name!r} defined in stallfree/"
    for split in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module or a class
        owner, rest = ".".join(parts[:split]), parts[split:]
        if owner in index.modules:
            if rest[0] in index.modules[owner] or f"{owner}.{rest[0]}" in index.modules:
                return None
            if "." not in owner and any(rest[-1] in attrs for attrs in index.classes.values()):
                return None  # `loader.state_dict()`: a variable named like a module, a real method
            return f"`{span}`: module {owner} defines no {rest[0]!r}"
        if owner in index.classes:
            if rest[0] in index.classes[owner]:
                return None
            return f"`{span}`: class {owner} has no {rest[0]!r}"
    return f"`{span}`: {parts[0]!r} is neither a stallfree module nor a class"


def spans(path: Path) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        out += [(n, s.strip()) for s in SPAN.findall(line)]
    return out


@pytest.fixture(scope="module")
def index() -> Index:
    return build_index()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_backticked_path_exists(doc: Path):
    missing = [f"{doc.name}:{n}: `{s}`" for n, s in spans(doc) if is_path(s) and not path_exists(s)]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", PATH_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_in_the_readme_and_examples_exists(doc: Path):
    missing = [f"{doc.name}:{n}: `{s}`" for n, s in spans(doc) if is_repo_path(s) and not path_exists(s)]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_backticked_symbol_is_defined(doc: Path, index: Index):
    problems = [
        f"{doc.name}:{n}: {why}"
        for n, s in spans(doc)
        if not is_path(s) and (why := symbol_problem(s, index)) is not None
    ]
    assert not problems, "names that stallfree/ does not define:\n" + "\n".join(problems)


def layer_table(text: str) -> dict[str, set[str] | None]:
    """ARCHITECTURE's layer table: package -> the packages of ours it may import (None: anything)."""
    table: dict[str, set[str] | None] = {}
    for line in text.splitlines():
        m = re.match(r"^\| `stallfree/(\w+)/` \|.*\| (?P<may>[^|]*) \|$", line)
        if m:
            may = m.group("may").strip()
            table[m.group(1)] = (
                None if may == "anything" else set(SPAN.findall(re.sub(r"\([^)]*\)", "", may)))
            )
    return table


def test_the_layer_table_allows_every_import_the_package_makes():
    """Every edge between packages in today's import graph (tests/test_imports.py's, which sees
    function-level imports too) is one the layer table lists."""
    from tests.test_imports import import_graph

    table = layer_table((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert {"shards", "cache", "loader", "harness", "cli"} <= set(table)

    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "stallfree"

    unlisted = sorted(
        f"{module} imports {target} (line {edge.line}, {edge.where})"
        for module, edges in import_graph().items()
        for target, edge in edges.items()
        if package(module) in table
        and table[package(module)] is not None
        and package(target) != package(module)
        and package(target) not in table[package(module)]
    )
    assert not unlisted, "imports the layer table of docs/ARCHITECTURE.md does not list:\n" + "\n".join(
        unlisted
    )


def test_the_checker_catches_what_it_is_for(index: Index):
    assert (
        path_exists("loader/shm/storage.py")
        and path_exists("stallfree/loader/")
        and path_exists("test_imports.py")
    )
    assert not path_exists("loader/mmap_reader.py")
    assert is_repo_path("benchmarks/RESULTS.md") and is_repo_path("tests/gpu/")
    assert not any(map(is_repo_path, ["/", "s3://b/x.py", 'open_dataset("a/b.py")', "path/name", "x/*.py"]))
    assert symbol_problem("shm.storage.materialise", index) is None
    assert symbol_problem("MainPlan.depth", index) is None
    assert symbol_problem("Task(gen, seq, indices, decode_seed, epoch)", index) is None
    assert symbol_problem("stallfree.normalize", index) is None
    assert symbol_problem('uneven="pad"', index) is None
    assert symbol_problem("os.environ", index) is None
    assert "no 'materialize'" in symbol_problem("shm.storage.materialize", index)
    assert "has no 'deepth'" in symbol_problem("MainPlan.deepth", index)
    assert "no 'NoSuchReader'" in symbol_problem("NoSuchReader", index)
    assert symbol_problem("v1.2 N", index) is None  # not a name
    assert symbol_problem("loader.state_dict()", index) is None  # a loader variable's method
    assert symbol_problem("index.json", index) is None and symbol_problem("GLOO_SOCKET_IFNAME", index) is None
    assert symbol_problem("manifest.shards.bin", index) is None  # a file name with dots
    assert "no 'tarr'" in symbol_problem("shards.tarr", index)  # but module paths are still checked
    table = layer_table(
        "| `stallfree/a/` | job | nothing |\n| `stallfree/b/` | job | `a` (errors), the `stallfree` package |\n"
        "| `stallfree/c/` | job | anything |"
    )
    assert table == {"a": set(), "b": {"a", "stallfree"}, "c": None}


# ---- the README as a front page, and the figures it links (issue 31 item 5) ---------------------

README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
README_MAX_BYTES = 8 * 1024


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped (word
    characters, spaces and hyphens kept), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {
        github_anchor(m.group(1))
        for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    }


def front_page(text: str) -> str:
    """What a newcomer reads first: the README up to its list of guide pages."""
    return text[: text.index("\n## The guide")]


def test_the_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= README_MAX_BYTES, f"README.md is {len(text.encode())} bytes"
    first = front_page(text)
    # the swap, first of all
    swap = first[first.index("```python") : first.index("```", first.index("```python") + 3)]
    assert "from stallfree import DataLoader" in swap and "from torch.utils.data import DataLoader" in swap
    assert len(swap.strip().splitlines()) - 1 <= 6
    # the Quick start: exactly the two commands
    quick = first[first.index("\n## Quick start") :]
    block = quick[quick.index("```bash\n") + 8 : quick.index("\n```", quick.index("```bash\n"))]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]
    assert "pip install stallfree" in first and "| extra | installs | for |" in first
    # no test-suite timings before the guide (docs/development.md has them)
    assert not re.search(r"\d+\s*min(utes)?\b|\d+:\d\d\b", first), (
        "a test timing on the README's first screen"
    )


def test_the_readme_headline_ratios_name_a_baseline_and_link_their_table():
    first = front_page(README.read_text(encoding="utf-8"))
    measured = first[first.index("\n## Measured") :]
    headlines = re.findall(r"^- \*\*(.+?)\*\*(.*?)(?=^- |\Z)", measured, flags=re.MULTILINE | re.DOTALL)
    assert len(headlines) == 3
    for bold, rest in headlines:
        assert re.search(r"\d(\.\d+)?x", bold), bold  # a ratio
        assert re.search(r"\(\d{4}-\d\d-\d\d;", rest), bold  # dated
        assert "benchmarks/RESULTS.md#" in rest, bold  # linked to its table


def test_every_link_to_a_results_section_names_one():
    known = anchors(RESULTS)
    broken = [
        f"{doc.relative_to(ROOT)}: #{frag}"
        for doc in [README, *PATH_DOCS[1:], RESULTS]
        for frag in re.findall(r"RESULTS\.md#([\w-]+)\)", doc.read_text(encoding="utf-8"))
        + (re.findall(r"\]\(#([\w-]+)\)", doc.read_text(encoding="utf-8")) if doc == RESULTS else [])
        if frag not in known
    ]
    assert not broken, "links to no heading of benchmarks/RESULTS.md:\n" + "\n".join(broken)


def test_results_open_with_the_current_figures_table():
    text = RESULTS.read_text(encoding="utf-8")
    assert re.findall(r"^## (.+)$", text, flags=re.MULTILINE)[0] == "Current figures"
    table = text[
        text.index("\n## Current figures") : text.index("\n## ", text.index("\n## Current figures") + 1)
    ]
    header, rule, *rows = [line for line in table.splitlines() if line.startswith("|")]
    assert header == "| capability | our figure | baseline (peer) | ratio | date (UTC) | command |"
    assert len(rows) >= 10
    capabilities = [re.match(r"^\| \[([^\]]+)\]\(#([\w-]+)\) \|", row) for row in rows]
    assert all(capabilities), rows
    assert len({m.group(2) for m in capabilities}) == len(rows), (
        "a capability with two rows: one row per capability (merge its figures into one row)"
    )
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 6, row
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", cells[4]), row
        assert cells[5].startswith("`") and "benchmarks/" in cells[5], row


def test_github_anchor():
    assert github_anchor("Decode + augment") == "decode--augment"
    assert github_anchor("Object storage (S3)") == "object-storage-s3"
    assert (
        github_anchor("Multi-node: stall per node, storage per epoch")
        == "multi-node-stall-per-node-storage-per-epoch"
    )

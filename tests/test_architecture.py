"""docs/ARCHITECTURE.md's statements, checked where a test can (issue 31): its folder table covers
every module of ``stallfree/`` once and names only folders that exist, each within the module
count it states; its layer table states the rules ``tests/test_imports.py`` enforces; what it says
the loader, ``mix``, ``errors`` and ``extras`` import is what they import; the ``Task(...)`` it
writes is the message's field list; and with no workers the loader stages nothing.

Paths and names in backticks are checked by ``tests/test_docs.py``; this file checks what the
sentences claim about them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.test_docs import layer_table
from tests.test_imports import import_graph

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stallfree"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
MAX_MODULES = 20  # "each holds at most 20 modules"


def section(text: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## `` heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def folder_rows(text: str) -> list[str]:
    """The folder column of the "The folders" table, as paths relative to the repository."""
    rows = re.findall(r"^\| `([\w/]+/)` \|", section(text, "The folders"), flags=re.MULTILINE)
    return [r.rstrip("/") if r == "stallfree/" else f"stallfree/{r.rstrip('/')}" for r in rows]


def module_folders() -> dict[str, list[str]]:
    """Each folder of ``stallfree/`` holding modules -> its modules (``__init__.py`` included)."""
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        out.setdefault(path.parent.relative_to(ROOT).as_posix(), []).append(path.name)
    return out


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_folder_row_exists_and_every_module_belongs_to_one(text: str):
    rows = folder_rows(text)
    assert len(rows) == len(set(rows)), f"a folder listed twice: {rows}"
    missing = [r for r in rows if not (ROOT / r).is_dir()]
    assert not missing, f"folder rows naming no folder: {missing}"
    unlisted = sorted(set(module_folders()) - set(rows))
    assert not unlisted, (
        "folders of stallfree/ with modules but no row in docs/ARCHITECTURE.md's folder table "
        f"(add one): {unlisted}"
    )


def test_no_folder_holds_more_modules_than_the_document_says(text: str):
    assert f"at most {MAX_MODULES} modules" in " ".join(section(text, "The folders").split())
    over = {f: len(m) for f, m in module_folders().items() if len(m) - ("__init__.py" in m) > MAX_MODULES}
    assert not over, f"folders over {MAX_MODULES} modules: {over}"


def _layering_rules() -> dict[str, set[str]]:
    """tests/test_imports.py's layering rules: package -> the packages of ours it may import,
    as the layer table names them (``stallfree.storage`` -> ``storage``), itself left out."""
    from tests.test_imports import test_layering

    (mark,) = [m for m in test_layering.pytestmark if m.name == "parametrize"]
    rules = {}
    for source, allowed in mark.args[1]:
        name = source.split(".", 1)[1]
        rules[name] = {a.split(".", 1)[1] for a in allowed} - {name}
    return rules


def test_the_layer_table_states_the_rules_test_imports_enforces(text: str):
    table = layer_table(text)
    rules = _layering_rules()
    assert {"storage", "shards", "cache"} <= set(rules)
    for package, allowed in rules.items():
        if package == "errors":  # a module, not a package: stated in prose below the table
            assert "`stallfree/errors.py`" in text and "import nothing of ours" in text
            continue
        assert package in table, f"no layer-table row for stallfree/{package}/"
        assert table[package] == allowed, (
            f"stallfree/{package}/: the layer table says it may import {sorted(table[package] or [])}, "
            f"tests/test_imports.py allows {sorted(allowed)}"
        )
    rules_text = " ".join(section(text, "The rules").split())
    assert "`storage` imports only `errors`" in rules_text
    assert "`shards` only `storage` and `errors`" in rules_text


def _imports_of(graph, prefix: str) -> set[str]:
    """Our modules imported by the modules under ``prefix``, outside it."""
    return {
        target
        for module, edges in graph.items()
        if module == prefix or module.startswith(prefix + ".")
        for target in edges
        if not (target == prefix or target.startswith(prefix + "."))
    }


def test_what_the_document_says_some_modules_import(text: str, graph):
    assert "The loader does not import `gpu_decode` or `tokens`" in " ".join(text.split())
    loader = _imports_of(graph, "stallfree.loader")
    assert not {t for t in loader if t.startswith(("stallfree.gpu_decode", "stallfree.tokens"))}
    # the layer table: of mix, the loader imports only mix/permute.py
    assert {t for t in loader if t.startswith("stallfree.mix")} <= {"stallfree.mix.permute"}
    # trace sits above the loader: the loader never imports it (samples_at's work is in epoch/)
    assert not {t for t in loader if t.startswith("stallfree.trace")}
    assert layer_table(text)["mix"] == set()
    assert _imports_of(graph, "stallfree.mix") == set()
    assert graph["stallfree.errors"] == {} and graph["stallfree.extras"] == {}


def test_the_task_message_is_written_with_its_fields(text: str):
    from stallfree.loader.messages import Task

    written = re.findall(r"`Task\(([^)]*)\)`", text)
    assert written, "docs/ARCHITECTURE.md no longer writes Task(...)"
    fields = [f.name for f in dataclasses.fields(Task)]
    for args in written:
        assert [a.strip() for a in args.split(",")] == fields


def test_with_no_workers_nothing_is_staged(tmp_path: Path):
    """ "With no workers nothing is staged": for block order over a remote dataset the plan
    stages whole shards with workers and none without."""
    from stallfree.loader.options import LoaderOptions, staging_for
    from stallfree.shards import ShardWriter, open_dataset
    from stallfree.storage.staging import Staging
    from stallfree.testing.httpserve import serve_directory

    with ShardWriter(str(tmp_path / "ds"), max_samples=2) as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "bin": bytes([i]) * 10})
    with serve_directory(tmp_path) as http:
        ds = open_dataset(f"{http.url}/ds")
        staging = Staging(root=str(tmp_path / "stage"))
        with_workers = staging_for(ds, LoaderOptions(num_workers=2, staging=staging), "block")
        without = staging_for(ds, LoaderOptions(num_workers=0, staging=staging), "block")
    assert with_workers is staging
    assert without is None
    assert "With no workers nothing is staged" in " ".join(DOC.read_text(encoding="utf-8").split())


def test_the_checks_catch_what_they_are_for():
    doc = "x\n## The folders\n\n| `stallfree/` | a |\n| `shards/tar/` | b |\n| `nope/` | c |\n\n## Next\n"
    assert folder_rows(doc) == ["stallfree", "stallfree/shards/tar", "stallfree/nope"]
    assert not (ROOT / "stallfree/nope").is_dir()
    assert "stallfree/shards/tar" in module_folders()
    assert _layering_rules()["storage"] == {"errors"}

"""A path that needs a pip extra ends in one line naming it, never a traceback (issue 30 item 4):
``stallfree.extras.require`` / ``MissingExtra``, and the CLI run with the library made unimportable
in a subprocess (a meta-path finder that says it is not installed)."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.extras import EXTRAS, MissingExtra, missing_extra_of, require

ROOT = Path(__file__).resolve().parents[2]

# Runs ``stallfree ARGS`` with MODULE (comma-separated modules, and their submodules) not importable,
# as when not installed.
ABSENT = """
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in {module!r}.split(",")):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from stallfree.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without(module: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ABSENT.format(module=module), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def assert_one_line_naming(r: subprocess.CompletedProcess, command: str, module: str, extra: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"stallfree {command}: error: "), lines[0]
    assert f"needs {module}: pip install 'stallfree[{extra}]'" in lines[0], lines[0]


def test_cache_stats_without_redis_names_the_redis_extra(tmp_path: Path):
    r = run_without("redis", "cache", "stats", "redis://127.0.0.1:1", "--password", "x", cwd=tmp_path)
    assert_one_line_naming(r, "cache stats", "redis", "redis")


def test_bench_plot_without_matplotlib_names_the_plot_extra_before_running(tmp_path: Path):
    r = run_without(
        "matplotlib",
        "bench",
        "synthetic:8:16x16",
        "--nproc",
        "1",
        "--steps",
        "1",
        "--plot",
        str(tmp_path / "out.png"),
        cwd=tmp_path,
    )
    assert_one_line_naming(r, "bench", "matplotlib", "plot")
    assert r.stdout == ""  # refused before the bench ran: no table
    assert not (tmp_path / "out.png").exists()


def test_shard_tokenizer_without_tokenizers_names_the_tokens_extra(tmp_path: Path):
    (tmp_path / "docs.jsonl").write_text('{"text": "hello world"}\n')
    (tmp_path / "tokenizer.json").write_text("{}")
    r = run_without(
        "tokenizers",
        "shard",
        "docs.jsonl",
        "tokens",
        "--tokenizer",
        "tokenizer.json",
        "--no-progress",
        cwd=tmp_path,
    )
    assert_one_line_naming(r, "shard", "tokenizers", "tokens")
    assert not (tmp_path / "tokens").exists()


def test_an_s3_url_without_s3fs_names_the_s3_extra(tmp_path: Path):
    # fsspec raises its own ImportError from s3fs's ModuleNotFoundError; the CLI finds the extra
    r = run_without("s3fs", "inspect", "s3://bucket/ds", cwd=tmp_path)
    assert_one_line_naming(r, "inspect", "s3fs", "s3")


@pytest.mark.parametrize("command", ["inspect", "verify", "index"])
def test_an_s3_url_without_the_s3_extra_s_libraries_names_the_s3_extra(tmp_path: Path, command: str):
    # without the extra, s3fs's own dependencies are absent too; our S3 session code imports
    # aiobotocore before fsspec ever imports s3fs
    url = "s3://bucket/ds/shard-000000.tar" if command == "index" else "s3://bucket/ds"
    flags = ["--no-progress"] if command in ("index", "verify") else []
    r = run_without("s3fs,aiobotocore,botocore", command, url, *flags, cwd=tmp_path)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"stallfree {command}: error: "), r.stderr
    assert "pip install 'stallfree[s3]'" in lines[0], lines[0]


def test_require_returns_the_module_or_raises_missing_extra():
    assert require("json", "plot", "x").dumps([1]) == "[1]"
    with pytest.raises(MissingExtra) as info:
        require("stallfree_no_such_module", "plot", "stallfree bench --plot")
    exc = info.value
    assert isinstance(exc, ImportError)
    assert (exc.module, exc.extra, exc.name) == (
        "stallfree_no_such_module",
        "plot",
        "stallfree_no_such_module",
    )
    assert str(exc) == (
        "stallfree bench --plot needs stallfree_no_such_module: pip install 'stallfree[plot]' "
        "(or: pip install 'matplotlib>=3.7')"
    )
    again = pickle.loads(pickle.dumps(exc))  # a worker's error reaches the main process whole
    assert (type(again), str(again), again.extra, again.module) == (
        MissingExtra,
        str(exc),
        "plot",
        exc.module,
    )
    with pytest.raises(ValueError, match="unknown extra 'plots'"):
        require("json", "plots", "x")


def test_require_keeps_an_installed_library_s_own_import_error(tmp_path: Path, monkeypatch):
    # a library that is there but fails to import (a dependency of its own missing) is not
    # "install the extra": its own error says more
    (tmp_path / "brokenlib.py").write_text("import stallfree_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("brokenlib", "plot", "x")
    assert not isinstance(info.value, MissingExtra)
    assert info.value.name == "stallfree_missing_dependency"


def test_missing_extra_of_follows_the_cause_chain():
    try:
        try:
            raise ModuleNotFoundError("No module named 's3fs'", name="s3fs")
        except ModuleNotFoundError as inner:
            raise ImportError("Install s3fs to access S3") from inner
    except ImportError as outer:
        found = missing_extra_of(outer)
    assert found is not None and (found.module, found.extra) == ("s3fs", "s3")
    # a missing parent package names the extra's module; the CUDA 12 DALI extra is the default
    found = missing_extra_of(ModuleNotFoundError("No module named 'nvidia'", name="nvidia"))
    assert found is not None and (found.module, found.extra) == ("nvidia.dali", "dali")
    assert missing_extra_of(ModuleNotFoundError("x", name="yaml")) is None
    assert missing_extra_of(ValueError("x")) is None


def test_the_extras_table_is_pyproject_s():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {name: tuple(reqs) for name, reqs in declared.items() if name != "dev"}
    assert {name: extra.requirements for name, extra in EXTRAS.items()} == declared


def test_the_readme_install_table_lists_every_extra_and_what_it_installs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w-]+)` \| ([^|]+) \|", text, flags=re.MULTILINE)
    assert [name for name, _ in rows] == list(EXTRAS)
    for name, installs in rows:
        dists = {r.split(">")[0].split("=")[0] for r in EXTRAS[name].requirements}
        assert set(re.findall(r"`([\w-]+)`", installs)) == dists, name


def test_a_missing_dali_names_both_cuda_builds():
    # the two DALI extras provide one module: naming only the CUDA 12 one sends a user of PyPI's
    # torch (CUDA 13) to a DALI that cannot share its process
    exc = MissingExtra("nvidia.dali", "dali", "the DALI loader of stallfree bench (--loader dali)")
    assert str(exc) == (
        "the DALI loader of stallfree bench (--loader dali) needs nvidia.dali: "
        "pip install 'stallfree[dali]' (or: pip install 'nvidia-dali-cuda120>=1.30'); "
        'or, for torch built for CUDA 13 (python -c "import torch; print(torch.version.cuda)"): '
        "pip install 'stallfree[dali-cuda13]'"
    )
    found = missing_extra_of(ModuleNotFoundError("No module named 'nvidia'", name="nvidia"))
    assert found is not None and "stallfree[dali-cuda13]" in str(found)


LIBRARY_WITHOUT = ABSENT.replace(
    "from stallfree.cli import main\nsys.exit(main(sys.argv[1:]))",
    "import stallfree\ntry:\n    stallfree.open_dataset(sys.argv[1])\n"
    "except ImportError as exc:\n    print(type(exc).__name__, exc)\n",
)


def test_open_dataset_of_an_s3_url_without_s3fs_names_s3fs_not_aiobotocore(tmp_path: Path):
    """In the library (no CLI to reword it): fsspec's own "install s3fs" error, not a bare
    ModuleNotFoundError for aiobotocore from our session code, which ran first."""
    r = subprocess.run(
        [sys.executable, "-c", LIBRARY_WITHOUT.format(module="s3fs,aiobotocore,botocore"), "s3://bucket/ds"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "s3fs" in r.stdout and "aiobotocore" not in r.stdout, r.stdout

"""Every Python block and every ``stallfree ...`` command line of README.md and docs/*.md runs,
on tiny data (build item 6).

How it runs: one subprocess (``_drive``) prepares a temporary directory holding the data the
docs name (``./imagenet/train`` as a small ImageFolder of real photos, ``tokens/*.parquet``,
``./old-webdataset/*.tar``, ``data/web_text_document`` token files, ...) and runs every block of
every file in document order in it: Python blocks ``exec`` in one namespace per file (the README
builds ``ds``, then a loader over it, ...), command lines go to ``stallfree.cli.main`` in the
same process after bash has expanded them (globs, quotes). One process keeps the whole test to
one interpreter start: the bench lines run with one rank and no worker processes (``TINY_BENCH``),
which ``stallfree bench`` runs in the calling process.

What the docs assume and the test provides:
- ``prepare`` returns the names a Python block may use without defining them (the reader's own
  data: ``items``, ``epochs``, and ``dataset``, a plain torch map-style dataset for the README's
  drop-in swap).
- ``SUBSTITUTIONS`` scale the docs' production settings down to a 2-core CI machine and point
  their placeholder URLs at what exists here (an S3 bucket becomes a local directory, the
  ``http://127.0.0.1:8000`` of the docs becomes a real loopback server on a free port). Each has
  a reason; nothing else in a block is changed.
- Lines of a ``bash`` block that are not ``stallfree`` commands (``torchrun``, ``cd``) are not run.

Marker: a block that cannot run here is preceded by ``<!-- readme-test: skip (REASON) -->`` (only
blank lines between the marker and the fence); it is reported as skipped with that reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The guide's reading order first: docs/sharding.md writes ./in1k, which the later pages open;
# then every other page, sorted (a page added to docs/ runs without being listed here).
GUIDE = ["sharding.md", "loader.md", "cache.md", "decode.md", "bench.md", "tokens.md", "metrics.md"]
DOCS = [
    ROOT / "README.md",
    *(ROOT / "docs" / name for name in GUIDE),
    *sorted(
        p for p in (ROOT / "docs").glob("**/*.md") if p.relative_to(ROOT / "docs").as_posix() not in GUIDE
    ),
]
DRIVE_TIMEOUT_S = 420

FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*readme-test:\s*skip\s*\((?P<reason>.+)\)\s*-->\s*$")
LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash"}

# (pattern, replacement, why): applied to the text of every block before it runs.
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    (r"s3://bucket/", "./bucket/", "no network in CI: a local directory stands in for the bucket"),
    (r"http://127\.0\.0\.1:8000/", "{http}/", "the docs' loopback URL: a real server on a free port"),
    (r"/dev/shm/stallfree", "./node-cache", "the test's own directory, not the machine's /dev/shm"),
    *[
        (
            rf"stallfree staging {action}",
            f"stallfree staging {action} --root ./staging",
            "the test's own staging directory, not the machine's (clear would free its copies)",
        )
        for action in ("list", "clear")
    ],
    (r'device="cuda"', "{device}", "CPU-only CI: the same loader without the device copy"),
    (r"num_workers=8", "num_workers=2", "2-core CI machine"),
    (r"--workers 8", "--workers 2", "2-core CI machine"),
    (r"--nproc 8", "--nproc 1", "2-core CI machine"),
    (r"--steps 200", "--steps 2", "tiny data: a few steps"),
]
# Appended to every `stallfree bench` line (argparse: the last value wins), so a bench of the
# docs' shape runs in seconds on tiny data.
TINY_BENCH = (
    "--nproc 1 --steps 2 --warmup 1 --batch-size 4 --workers 0 --image-size 16 --step-ms 1 "
    "--tune-workers 0 --tune-prefetch 2 --device cpu"
)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text, and why it is skipped (if it is)."""

    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str  # "python" or "bash"
    code: str
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def extract_blocks(text: str, path: str) -> list[Block]:
    """The python and bash blocks of a Markdown text, with their skip markers."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, LANGS.get(m.group(2).lower())
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        if lang is not None:
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = MARKER.match(lines[k]) if k >= 0 else None
            indent = len(m.group(1))
            code = "\n".join(line[indent:] for line in lines[start + 1 : j]) + "\n"
            blocks.append(Block(path, start + 1, lang, code, marker.group("reason") if marker else None))
        i = j + 1
    return blocks


def command_lines(code: str) -> list[str]:
    """The ``stallfree ...`` commands of a bash block: continuation lines joined, comments kept for
    bash to drop."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("stallfree ")]


def substitute(code: str, values: dict[str, str]) -> str:
    for pattern, replacement, _why in SUBSTITUTIONS:
        code = re.sub(pattern, replacement.format(**values).replace("\\", "\\\\"), code)
    return code


def all_blocks() -> list[Block]:
    return [b for p in DOCS for b in extract_blocks(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]


# ---- the subprocess ------------------------------------------------------------------------------


def prepare(root: Path) -> dict[str, object]:
    """The tiny data the docs' paths name, under ``root``; returns the reader's Python names."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stallfree.shards.writer import ShardWriter
    from stallfree.testing.images import jpeg_bytes, make_image_folder
    from stallfree.tokens.megatron import MegatronWriter

    small = ((96, 72), (72, 96), (80, 60))
    make_image_folder(root / "imagenet" / "train", classes=3, per_class=6, sizes=small)
    (root / "tokens").mkdir()
    for p in range(2):
        ids = [list(range(p * 10 + i, p * 10 + i + 5)) for i in range(4)]
        pq.write_table(pa.table({"input_ids": ids}), root / "tokens" / f"part-{p}.parquet")
    old = root / "old-webdataset"
    images = jpeg_bytes(8, sizes=small)
    with ShardWriter(str(old), max_samples=4) as w:
        for i, jpeg in enumerate(images):
            w.write({"__key__": f"old{i:03d}", "jpg": jpeg, "cls": i % 2})
    for f in [*old.glob("*.idx"), old / "manifest.json"]:  # plain WebDataset tars, no index
        f.unlink()
    (root / "data").mkdir()
    rng = np.random.default_rng(0)
    with MegatronWriter(str(root / "data" / "web_text_document"), dtype="uint16") as w:
        for _ in range(12):
            w.write(rng.integers(0, 50_000, 700))
    rng.integers(0, 50_000, 9_000).astype(np.uint16).tofile(root / "data" / "code.bin")
    return {
        "items": [(f"img{i:03d}", jpeg, i % 3) for i, jpeg in enumerate(jpeg_bytes(12, sizes=small))],
        "epochs": 1,
        "dataset": _Vectors(),
    }


class _Vectors:
    """The reader's own map-style dataset: 512 small float vectors with an int label (two of the
    README's 256-sample batches)."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict:
        import torch

        return {"x": torch.full((4,), float(i)), "label": i % 10}


def _run_python(block: Block, code: str, ns: dict) -> None:
    exec(compile(code, block.id, "exec"), ns)


def _run_commands(code: str, cwd: Path) -> list[str]:
    """Run each ``stallfree`` line through ``stallfree.cli.main``; the argv is what bash makes of
    the line (globs expanded, quotes removed, comments dropped). Returns each line's failure."""
    import traceback

    from stallfree.cli import main

    failures = []
    for line in command_lines(code):
        if line.startswith("stallfree bench "):
            line = f"{line.split('#', 1)[0]} {TINY_BENCH}"
        argv = subprocess.run(
            ["bash", "-c", f'printf "%s\\0" {line}'], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.split("\0")[:-1]
        try:
            rc = main(argv[1:])
        except SystemExit as exc:  # argparse refusals
            rc = exc.code
        except Exception:  # noqa: BLE001 (reported; the block's next lines still run)
            rc = "an exception: " + traceback.format_exc(limit=-3)
        if rc != 0:
            failures.append(f"{line}: exit {rc}")
    return failures


def _drive(plan_path: str) -> None:
    """Subprocess entry: run the plan's blocks in its directory, one JSON line per block."""
    import contextlib
    import io
    import time
    import traceback

    import torch

    from stallfree.testing.httpserve import serve_directory

    plan = json.loads(Path(plan_path).read_text())
    root, out = Path(plan["root"]), open(plan["results"], "a", encoding="utf-8")  # noqa: SIM115
    os.chdir(root)
    reader = prepare(root)
    with serve_directory(root) as http:
        values = {
            "http": http.url,
            "device": 'device="cuda"' if torch.cuda.is_available() else 'device="cpu"',
        }
        namespaces: dict[str, dict] = {}
        for raw in plan["blocks"]:
            block = Block(**raw)
            if block.skip:
                continue
            code = substitute(block.code, values)
            buf = io.StringIO()
            error, t0 = None, time.perf_counter()
            try:
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                    if block.lang == "python":
                        ns = namespaces.setdefault(block.path, {"__name__": "__readme__", **reader})
                        _run_python(block, code, ns)
                    else:
                        failures = _run_commands(code, root)
                        if failures:
                            error = "; ".join(failures)
            except BaseException:  # noqa: BLE001 (a block's failure is reported, the rest still run)
                error = traceback.format_exc(limit=-3)
            row = {"id": block.id, "error": error, "seconds": round(time.perf_counter() - t0, 2)}
            out.write(json.dumps({**row, "output": buf.getvalue()[-3000:]}) + "\n")
            out.flush()


# ---- the tests -------------------------------------------------------------------------------------

BLOCKS = all_blocks()

# One driver run serves every block's test: on one xdist worker (scripts/test.sh runs
# --dist loadgroup), so no other worker sits blocked on the driver's lock (98 s of a worker in
# the suite's longest pass), and started first, as the slow tests are (tests/conftest.py).
# Ray's and Spark's blocks stay on loopback (what stallfree.testing's cluster helpers set; not
# imported here: importing them sets the variables in this process)
ENGINES_LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "SPARK_LOCAL_IP": "127.0.0.1",
}
pytestmark = [pytest.mark.xdist_group("readme-driver"), pytest.mark.slow]


def _run_driver(base: Path) -> dict[str, dict]:
    root, results_path = base / "work", base / "results.jsonl"
    root.mkdir()
    plan = {"root": str(root), "results": str(results_path), "blocks": [b.__dict__ for b in BLOCKS]}
    (base / "plan.json").write_text(json.dumps(plan))
    # without ENGINES_LOOPBACK_ENV Ray rewrites 127.0.0.1 to the outside address
    env = {**os.environ, **ENGINES_LOOPBACK_ENV, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    code = f"from tests.test_readme import _drive; _drive({str(base / 'plan.json')!r})"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=DRIVE_TIMEOUT_S,
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        tail = f"timed out after {DRIVE_TIMEOUT_S} s: {exc}"
    found = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            row = json.loads(line)
            found[row["id"]] = row
    found["__tail__"] = {"output": tail}
    return found


@pytest.fixture(scope="session")
def results(tmp_path_factory) -> dict[str, dict]:
    """The driver's results, computed once per test session: under pytest-xdist the blocks' tests
    land on several workers, which share one run through a lock in the session's base directory
    (without the lock each worker would run every block again)."""
    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-N/, above every worker's popen-gwK/
    done = shared / "readme-results.json"
    with FileLock(str(shared / "readme-results.lock")):
        if not done.exists():
            base = shared / "readme"
            base.mkdir()
            done.write_text(json.dumps(_run_driver(base)))
    return json.loads(done.read_text())


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, results):
    if block.skip:
        pytest.skip(block.skip)
    if block.lang == "bash" and not command_lines(block.code):
        pytest.skip("no stallfree command line in this block (scripts and other tools are not run)")
    row = results.get(block.id)
    assert row is not None, f"{block.id} never ran; the driver said:\n{results['__tail__']['output']}"
    assert row["error"] is None, f"{block.id}:\n{row['error']}\n--- output ---\n{row['output']}"


def test_the_docs_have_blocks_to_run():
    kinds = {(b.path, b.lang) for b in BLOCKS if not b.skip}
    assert ("README.md", "python") in kinds and ("README.md", "bash") in kinds
    assert sum(len(command_lines(b.code)) for b in BLOCKS if b.lang == "bash" and not b.skip) >= 5


def test_extraction_markers_and_commands():
    text = (
        "intro\n```python\nx = 1\n```\n\n<!-- readme-test: skip (needs a GPU) -->\n\n```bash\n"
        "stallfree bench ./d \\\n    --nproc 8   # comment\ntorchrun x\n```\n```\nplain\n```\n"
        "- item:\n  ```python\n  y = 2\n  ```\n"
    )
    blocks = extract_blocks(text, "X.md")
    assert [(b.line, b.lang, b.skip) for b in blocks] == [
        (2, "python", None),
        (8, "bash", "needs a GPU"),
        (17, "python", None),
    ]
    assert blocks[0].code == "x = 1\n" and blocks[2].code == "y = 2\n"
    assert command_lines(blocks[1].code) == ["stallfree bench ./d --nproc 8   # comment"]
    assert substitute(
        'DataLoader(ds, num_workers=8, device="cuda")', {"http": "h", "device": 'device="cpu"'}
    ) == ('DataLoader(ds, num_workers=2, device="cpu")')

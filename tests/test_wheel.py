"""The install story a library user follows (issue 30 item 4): build a wheel from this tree,
install it with torch into a fresh venv, and run a tiny epoch there from a directory outside the
checkout, so the INSTALLED package is what runs (its C JPEG decoder included).

The wheel is built from a copy of the package sources (the build writes ``build/`` and
``*.egg-info`` beside them, which must not appear in a checkout others are working in), with the
C extension compiled afresh. torch and the dependencies come from the same places scripts/setup.sh
installs from (``setup.sh --uv-pip-args``: pip's configuration as uv flags), through uv's cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stallfree

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TORCH = "torch==2.13.0"  # the version CI tests, on local disk (requirements-dev.txt)
SOURCES = ("stallfree", "pyproject.toml", "setup.py", "README.md")

# Runs inside the new venv, in a directory outside the checkout.
EPOCH = """
import sys
from pathlib import Path

import stallfree
from stallfree import DataLoader, ShardWriter, open_dataset
from stallfree.gpu_decode.jpeg_info import jpeg_decoder

here = Path(stallfree.__file__).resolve()
assert "site-packages" in here.parts, here  # the installed package, not the checkout
with ShardWriter("ds", max_samples=5) as w:
    for i in range(13):
        w.write({"__key__": f"k{i:02d}", "bin": bytes([i]) * (i + 1), "cls": i % 3})
ds = open_dataset("ds")
assert len(ds) == 13 and ds[4]["bin"] == bytes([4]) * 5, ds[4]
for workers in (0, 2):
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers, seed=0)
    keys = [k for batch in loader for k in batch["__key__"]]
    assert sorted(keys) == [f"k{i:02d}" for i in range(13)], (workers, keys)
print("epoch ok", jpeg_decoder().name)
"""


def _uv_flags() -> tuple[list[str], dict[str, str]]:
    """scripts/setup.sh's uv flags for the dev venv's pip configuration, and the environment
    (the CA bundle pip trusts, for uv)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "--uv-pip-args", str(VENV_BIN.parent)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    flags, env = [], {}
    for line in out.splitlines():
        if line.startswith("CERT="):
            env["SSL_CERT_FILE"] = line.removeprefix("CERT=")
        elif line:
            flags.append(line)
    return flags, env


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would point Python at the checkout or the dev venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


def _user_env() -> dict[str, str]:
    """``_clean_env`` as a user's Python runs in the new venv: writing the bytecode it compiles
    (a PYTHONDONTWRITEBYTECODE of this machine's would have its second run compile torch's
    modules from source again, ~1.5 CPU-s; the venv is this test's own)."""
    return {k: v for k, v in _clean_env().items() if k != "PYTHONDONTWRITEBYTECODE"}


@pytest.mark.slow
def test_a_wheel_installs_into_a_fresh_venv_and_runs_an_epoch(tmp_path: Path):
    uv = shutil.which("uv", path=str(VENV_BIN))
    if uv is None or shutil.which("gcc") is None:
        pytest.skip("needs uv in the dev venv and gcc (scripts/setup.sh installs both)")
    timings = {}
    t0 = time.perf_counter()
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(dist),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_clean_env(),
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = list(dist.glob("stallfree-*.whl"))
    assert len(wheels) == 1, wheels
    timings["build"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    flags, uv_env = _uv_flags()
    install = subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), *flags, str(wheels[0]), TORCH],
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(**uv_env),
    )
    assert install.returncode == 0, install.stderr[-3000:]
    timings["install"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    work = tmp_path / "work"  # outside the checkout: `import stallfree` finds the installed one
    work.mkdir()
    epoch = subprocess.run(
        [str(venv / "bin" / "python"), "-c", EPOCH],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=work,
        env=_user_env(),
    )
    assert epoch.returncode == 0, epoch.stderr[-3000:]
    assert epoch.stdout.splitlines()[-1] == "epoch ok turbo"  # the wheel's C JPEG decoder built and loads
    version = subprocess.run(
        [str(venv / "bin" / "stallfree"), "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=work,
        env=_user_env(),
    )
    assert version.returncode == 0, version.stderr
    lines = version.stdout.splitlines()
    assert lines[0] == f"stallfree {stallfree.__version__}"
    assert lines[1].startswith("torch 2.13.0")
    assert lines[2].startswith("jpeg decoder: turbo (")
    timings["run"] = time.perf_counter() - t0
    print("wheel test seconds:", {k: round(v, 1) for k, v in timings.items()})

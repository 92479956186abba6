"""``stallfree doctor``: what this install has and lacks, one line per check (``--json`` too).

A new user's first failures are environmental: the C JPEG decoder not built (every image then
goes through PIL, several times the CPU), DALI built for another CUDA than torch, no
redis-server for the cluster cache, an extra not installed. Each shows here before a run rather
than as a slow epoch or a traceback in one. ``stallfree --version`` prints the first lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

from stallfree.cli._common import describe

# what a check found: "ok"; "missing" (optional and absent: a feature unavailable, nothing wrong);
# "warn" (works, but slower or narrower than it should: fix it when you can); "problem" (present
# but wrong, a run would fail: the command exits 1)
OK, MISSING, WARN, PROBLEM = "ok", "missing", "warn", "problem"

# the DALI and nvImageCodec distributions and the CUDA major version each is built for
DALI_DISTRIBUTIONS = {"nvidia-dali-cuda120": 12, "nvidia-dali-cuda130": 13}
NVIMGCODEC_DISTRIBUTIONS = {"nvidia-nvimgcodec-cu12": 12, "nvidia-nvimgcodec-cu13": 13}


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report: ``name: detail`` with its ``status``."""

    name: str
    status: str
    detail: str

    def line(self) -> str:
        mark = {OK: "ok", MISSING: "--", WARN: "!!", PROBLEM: "XX"}[self.status]
        return f"[{mark}] {self.name + ':':<15} {self.detail}"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this install: versions, JPEG decoder, DALI vs torch CUDA, redis-server, extras",
        description=describe(
            "One line per check: stallfree, Python and torch versions (and torch's CUDA build), the "
            "JPEG decoder the CPU decode uses and why, DALI and whether the CUDA it is built for "
            "matches torch's, redis-server on PATH (for stallfree cache serve), and each pip extra "
            "installed or not. [ok] present, [--] optional and absent, [!!] works but should be fixed, "
            "[XX] a problem a run would fail on (exit 1)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree doctor\n  stallfree doctor --json",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    checks = collect()
    if args.json:
        print(json.dumps(as_json(checks), indent=1))
    else:
        for check in checks:
            print(check.line())
    return 1 if any(c.status == PROBLEM for c in checks) else 0


def version_lines() -> list[str]:
    """``stallfree --version``: stallfree's version, torch's, and the JPEG decoder with its reason."""
    from stallfree import __version__

    return [
        f"stallfree {__version__}",
        f"torch {_torch_check().detail}",
        f"jpeg decoder: {_jpeg_check().detail}",
    ]


def collect() -> list[Check]:
    """Every check, in the order printed."""
    from stallfree import __version__
    from stallfree.extras import EXTRAS

    checks = [
        Check("stallfree", OK, f"{__version__} ({_location()})"),
        Check("python", OK, f"{platform.python_version()} ({sys.executable})"),
        _torch_check(),
        _jpeg_check(),
        _dali_check(),
        _nvimgcodec_check(),
        _redis_server_check(),
    ]
    for extra in EXTRAS.values():
        versions = extra.versions()
        shown = ", ".join(f"{dist} {v or 'not installed'}" for dist, v in versions.items())
        checks.append(
            Check(
                f"[{extra.name}]",
                OK if extra.installed() else MISSING,
                f"{shown}: {extra.purpose}",
            )
        )
    return checks


def _location() -> str:
    import stallfree

    return str(stallfree.__file__).rsplit("/", 2)[0]


def _torch_check() -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", PROBLEM, f"not importable: {exc}")
    cuda = torch.version.cuda
    if cuda is None:
        return Check("torch", OK, f"{torch.__version__} (CPU build)")
    available = torch.cuda.is_available()
    gpus = f"{torch.cuda.device_count()} GPU(s) visible" if available else "no GPU visible"
    return Check("torch", OK, f"{torch.__version__} (built for CUDA {cuda}; {gpus})")


def _jpeg_check() -> Check:
    from stallfree.gpu_decode.jpeg_info import jpeg_decoder

    decoder = jpeg_decoder()
    # PIL works, but a missing C decoder is a build to fix (several times the CPU per image), not
    # an optional extra
    return Check("jpeg decoder", OK if decoder.name == "turbo" else WARN, str(decoder))


def cuda_major(installed: dict[str, str], distributions: dict[str, int]) -> int | None:
    """The CUDA major version the installed builds are made for (None: none, or several)."""
    majors = {distributions[d] for d in installed}
    return majors.pop() if len(majors) == 1 else None


def _installed(distributions: dict[str, int]) -> dict[str, str]:
    """Which of ``distributions`` are installed: name -> version."""
    found = {}
    for dist in distributions:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def _dali_check() -> Check:
    installed = _installed(DALI_DISTRIBUTIONS)
    if not installed:
        return Check(
            "dali",
            MISSING,
            "not installed: GPU decode uses nvImageCodec if present, else the CPU decoder "
            "(pip install 'stallfree[dali]' for torch built for CUDA 12, 'stallfree[dali-cuda13]' for CUDA 13)",
        )
    return _pair_check("dali", installed, DALI_DISTRIBUTIONS, {12: "dali", 13: "dali-cuda13"})


def _nvimgcodec_check() -> Check:
    installed = _installed(NVIMGCODEC_DISTRIBUTIONS)
    if not installed:
        return Check(
            "nvimgcodec",
            MISSING,
            "not installed: ImageDecode(backend='nvimgcodec') unavailable (pip install "
            "nvidia-nvimgcodec-cu13 nvidia-nvjpeg for torch built for CUDA 13)",
        )
    return _pair_check("nvimgcodec", installed, NVIMGCODEC_DISTRIBUTIONS, {})


def _pair_check(
    name: str, installed: dict[str, str], distributions: dict[str, int], extras: dict[int, str]
) -> Check:
    """Whether the installed build of a GPU library is made for the CUDA torch is built for: two
    CUDA runtimes in one process is a setup nobody tests, and the GPU decode hands its buffers to
    torch."""
    shown = ", ".join(f"{d} {v}" for d, v in installed.items())
    if len(installed) > 1:
        return Check(name, PROBLEM, f"{shown}: two builds of one module; uninstall all but one")
    major = cuda_major(installed, distributions)
    torch_cuda = _torch_cuda()
    if torch_cuda is None:
        return Check(name, WARN, f"{shown} (CUDA {major}), but torch is a CPU build: no GPU decode")
    torch_major = int(torch_cuda.split(".")[0])
    if torch_major != major:
        want = extras.get(torch_major)
        fix = f"pip install 'stallfree[{want}]'" if want else f"install its CUDA {torch_major} build"
        return Check(
            name,
            PROBLEM,
            f"{shown} is built for CUDA {major}, torch for CUDA {torch_cuda}: uninstall it and {fix}",
        )
    return Check(name, OK, f"{shown}, CUDA {major}, as torch (CUDA {torch_cuda})")


def _redis_server_check() -> Check:
    path = shutil.which("redis-server")
    if path is None:
        return Check(
            "redis-server",
            MISSING,
            "not on PATH: stallfree cache serve needs it (Debian: apt-get install redis-server)",
        )
    version = _redis_server_version(path)
    return Check("redis-server", OK, f"{version or 'version unknown'} ({path})")


def _redis_server_version(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"v=(\S+)", out)
    return m.group(1) if m else None


def as_json(checks: list[Check]) -> list[dict[str, Any]]:
    """The checks as JSON-ready dicts (``--json``)."""
    return [dataclasses.asdict(c) for c in checks]

"""`stallfree bench` in a subprocess (with a timeout, so a hang fails the test): bad data ends
in one error line, and a multi-rank bench listens on loopback only. The subprocess is
``python -m stallfree bench`` forked from the test zygote (``tests/zygote.py``: torch imported
once, not in every run); the ranks it spawns are fresh interpreters, as always."""

from __future__ import annotations

import ipaddress
import os
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from tests.zygote import AS_MODULE, Child, start_python

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # generous: the machine is shared; a hang still fails instead of stalling the suite


def _bench(*argv: str) -> Child:
    """``python -m stallfree bench ARGV``, started."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return start_python(AS_MODULE, "stallfree", "bench", *argv, cwd=REPO, env=env)


def _finish(proc: Child) -> tuple[int, str, str]:
    """Its exit code, stdout and stderr once it ended; a run past ``TIMEOUT_S`` is killed (with
    the ranks of its session) and fails the test."""
    rc = proc.wait(TIMEOUT_S)
    if rc is None:
        proc.kill_session()
    out, err = proc.output()
    assert rc is not None, f"stallfree bench did not end within {TIMEOUT_S} s: {err[-3000:]}"
    return rc, out, err


def _cut(tmp: Path, where: str) -> tuple[Path, str, int]:
    """One tar shard of 64 JPEG samples, cut after its manifest was written: inside the header
    (``"header"``) or the data (``"data"``) of sample 32's ``jpg`` member. Returns the dataset,
    the tar's name, and its size before the cut."""
    from stallfree.harness.fixtures import write_jpeg_shards

    root = write_jpeg_shards(tmp / "shards", 64, per_shard=64, size=(48, 32))
    (tar,) = sorted(Path(root).glob("*.tar"))
    with tarfile.open(tar) as t:
        member = t.getmember("00000032.jpg")
    full = tar.stat().st_size
    os.truncate(tar, member.offset + 100 if where == "header" else member.offset_data + 64)
    return Path(root), tar.name, full


@pytest.fixture(scope="module")
def cut_in_data(tmp_path_factory) -> tuple[Path, str, int]:
    return _cut(tmp_path_factory.mktemp("cut-data"), "data")


def _run(root: Path, loader: str, nproc: int, workers: int, steps: int = 8) -> tuple[int, str]:
    rc, _, err = _finish(
        _bench(
            str(root),
            *("--nproc", str(nproc), "--loader", loader, "--workers", str(workers), "--batch-size", "4"),
            *("--steps", str(steps), "--image-size", "16", "--device", "cpu"),
        )
    )
    return rc, err


def _error_line(rc: int, err: str) -> str:
    """The last stderr line, once the run is known to have failed without a traceback."""
    assert rc == 1, err
    assert "Traceback" not in err, err
    return err.rstrip("\n").splitlines()[-1]


@pytest.mark.parametrize(
    "loader, nproc, prefix",
    [
        ("torch", 1, ""),  # torch's worker re-raises with the worker's traceback in the message
        ("stallfree", 1, ""),  # so does stallfree's
        ("torch", 2, "rank "),
    ],
)
@pytest.mark.slow
def test_truncated_shard_is_one_error_line(cut_in_data, loader, nproc, prefix):
    root, name, full = cut_in_data
    size = (root / name).stat().st_size
    line = _error_line(*_run(root, loader, nproc, workers=1))
    assert line.startswith("stallfree bench: error: " + prefix), line
    assert line.endswith(
        f"shard is truncated: {size} bytes on storage, the manifest says {full} (shard {name}, byte offset {size})"
    ), line


def test_webdataset_on_a_tar_cut_inside_a_member_names_the_shard(cut_in_data):
    pytest.importorskip("webdataset")
    root, name, _ = cut_in_data
    line = _error_line(*_run(root, "webdataset", 1, workers=0, steps=12))
    assert line == f"stallfree bench: error: cannot read tar: unexpected end of data (shard {name})"


def test_webdataset_on_a_tar_cut_inside_a_header_names_the_sample_cut_short(tmp_path):
    """tarfile takes a cut header for the end of the archive; the sample cut there arrives
    without its image."""
    pytest.importorskip("webdataset")
    root, _, _ = _cut(tmp_path, "header")
    line = _error_line(*_run(root, "webdataset", 1, workers=0, steps=12))
    assert line == (
        "stallfree bench: error: no image field (looked for jpg, jpeg, png, webp, bmp, ppm, pgm, tif, tiff, img, image; "
        "it has cls) (sample '00000032')"
    )


def _listening(root_pid: int) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket listening in the process tree under ``root_pid``."""
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="tcp"):  # LISTEN is a TCP state: no UDP tables read
                if conn.status == psutil.CONN_LISTEN:
                    found.add((proc.pid, conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
def test_two_rank_bench_listens_on_loopback_only():
    """The rendezvous store (and gloo's own sockets) accept connections from this machine only."""
    proc = _bench(
        "synthetic:64:32x24",
        *("--nproc", "2", "--loader", "torch", "--workers", "0", "--batch-size", "4"),
        *("--steps", "60", "--step-ms", "20", "--image-size", "16", "--device", "cpu"),
    )
    seen: set[tuple[int, str, int]] = set()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.wait(0) is None and time.monotonic() < deadline:
            seen |= _listening(proc.pid)
            time.sleep(0.05)
    finally:
        rc, out, err = _finish(proc)
    assert rc == 0, err
    assert seen, "no listening socket seen during a 2-rank bench: the check saw nothing"
    wide = sorted(s for s in seen if not ipaddress.ip_address(s[1]).is_loopback)
    assert not wide, f"listening beyond loopback (pid, address, port): {wide}"


def test_the_rendezvous_store_binds_loopback():
    """The store the launcher serves for its ranks, checked at construction."""
    from stallfree.harness.runner import loopback_store

    store, port = loopback_store(timeout_s=30)
    try:
        mine = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
        assert mine == {("127.0.0.1", port)}
    finally:
        del store

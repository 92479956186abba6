"""A training loop that raises mid-epoch ends the process promptly, on every loader path.

Each case runs a real script in a subprocess: it builds the loader, takes batches, records its
worker pids, then raises while it still holds a batch and the iterator (the traceback keeps both
alive until interpreter exit). The process must exit with the error within the timeout, its
workers must be gone, and it must leave nothing in /dev/shm. Before the fix, releasing a held
batch at interpreter exit waited forever on a multiprocessing queue.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.zygote import run_python

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import sys, psutil, torch
import stallfree
from stallfree import DataLoader, ImageDecode
from stallfree.cache import MemoryCache
from tests.loader.helpers import Numbers

def sharded(root):
    from stallfree.testing.images import jpeg_bytes
    with stallfree.ShardWriter(root, format="tar", max_samples=16) as w:
        for i, jpg in enumerate(jpeg_bytes(48, seed=3, sizes=((96, 64), (64, 96)))):
            w.write({"__key__": f"s{i:04d}", "jpg": jpg, "cls": str(i % 4).encode()})
    return stallfree.open_dataset(root)

class MainDecoder:
    runs_in_workers = False
    def decode_batch(self, samples, *, seed):
        return {"n": torch.tensor([len(s["jpg"]) for s in samples])}

def report(it):
    pids = [p.pid for p in psutil.Process().children(recursive=True)]
    print("PIDS", *pids, flush=True)
"""

LOADERS = {
    "plain": "DataLoader(Numbers(400), batch_size=16, shuffle=True, num_workers=2)",
    "sampler": "DataLoader(Numbers(400), batch_size=16, num_workers=2)",
    "sharded": "DataLoader(sharded(DIR), batch_size=8, shuffle=True, num_workers=2)",
    "sharded_cache": "DataLoader(sharded(DIR), batch_size=8, shuffle=True, num_workers=2, "
    "cache=MemoryCache(capacity_bytes=1 << 26))",
    "decode_in_workers": "DataLoader(sharded(DIR), batch_size=16, shuffle=True, num_workers=2, "
    "decode=ImageDecode(train=True, size=32, backend='cpu'))",
    "decode_in_main": "DataLoader(sharded(DIR), batch_size=8, shuffle=True, num_workers=2, decode=MainDecoder())",
    "persistent": "DataLoader(Numbers(400), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True)",
    "large_batches": "DataLoader(Numbers(100_000, width=1), batch_size=40_960, shuffle=True, num_workers=2)",
    "in_process": "DataLoader(sharded(DIR), batch_size=8, shuffle=True, num_workers=0)",
}


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _left_in_shm(before: set[str]) -> set[str]:
    """New shared-memory segments that stay after the run (a moment's grace for torch's cleanup).

    Named semaphores (``sem.*``) are left out: under fork, multiprocessing unlinks each one the
    moment it is made (strace shows open + unlink), so any that show up belong to other processes
    on the machine."""
    deadline = time.monotonic() + 5.0
    while True:
        left = {e for e in _shm() - before if not e.startswith("sem.")}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _run(body: str, tmp_path: Path, timeout: float = 30.0) -> tuple[subprocess.CompletedProcess, float]:
    script = PRELUDE + textwrap.dedent(body).replace("DIR", repr(str(tmp_path / "ds")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = run_python(script, cwd=ROOT, env=env, timeout=timeout)  # a fresh interpreter, torch preloaded
    return proc, time.monotonic() - t0


def _pids(stdout: str) -> list[int]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("PIDS"))
    return [int(p) for p in line.split()[1:]]


def _gone(pids: list[int]) -> list[int]:
    """The pids still alive (and not zombies) a moment after the parent exited."""
    deadline = time.monotonic() + 5.0
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.serial  # compares /dev/shm before and after: other tests' segments would show up
@pytest.mark.parametrize("path", sorted(LOADERS))
def test_a_raising_training_loop_exits_with_its_error(path, tmp_path):
    before = _shm()
    body = f"""
    dl = {LOADERS[path]}
    it = iter(dl)
    batch = next(it)
    batch = next(it)
    report(it)
    raise RuntimeError("training step failed")
    """
    proc, _ = _run(body, tmp_path)  # a hang past _run's timeout fails the test
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: training step failed" in proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert len(_pids(proc.stdout)) >= (0 if path == "in_process" else 2)
    assert _gone(_pids(proc.stdout)) == []
    assert _left_in_shm(before) == set()


@pytest.mark.parametrize("path", ["plain", "decode_in_workers", "persistent"])
def test_batches_alive_at_a_normal_exit_print_nothing(path, tmp_path):
    """Batches still referenced at interpreter exit are released silently (no 'Exception ignored')."""
    body = f"""
    dl = {LOADERS[path]}
    kept = [b for _, b in zip(range(3), dl)]
    it = iter(dl)
    more = next(it)
    report(it)
    """
    proc, _ = _run(body, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip() == "", proc.stderr[-3000:]
    assert _gone(_pids(proc.stdout)) == []


def test_a_slot_released_from_another_thread_after_the_iterator_is_gone_does_not_block(tmp_path):
    body = """
    import gc, threading
    dl = DataLoader(Numbers(64), batch_size=8, shuffle=True, num_workers=2)
    it = iter(dl)
    batch = next(it)
    del it
    gc.collect()
    report(None)
    t = threading.Thread(target=lambda: globals().pop("batch"))
    t.start(); t.join(5)
    print("ALIVE", t.is_alive(), flush=True)
    """
    proc, _ = _run(body, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ALIVE False" in proc.stdout
    assert _gone(_pids(proc.stdout)) == []


@pytest.mark.parametrize("order", ["block", "global"])
def test_a_remote_loader_left_open_at_exit_prints_nothing(order, tmp_path):
    """A script over remote shards that iterates partly and exits without closing the loader.

    Before: every such script ended with ``Exception ignored in DataLoader.__del__ ...
    'NoneType' object has no attribute 'debug'``: the loader was closed from ``__del__`` during
    interpreter teardown, its lead staging failed on a module global already None, and the
    handler logged through another. Now an exit hook closes it while modules still work."""
    import stallfree
    from stallfree.testing.httpserve import serve_directory

    root = tmp_path / "ds"
    with stallfree.ShardWriter(str(root), format="tar", max_samples=8) as w:
        for i in range(64):
            w.write({"__key__": f"s{i:04d}", "txt": b"x" * 2000, "cls": str(i % 4).encode()})
    with serve_directory(root) as srv:
        body = f"""
        ds = stallfree.open_dataset({srv.url!r})
        dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, order={order!r})
        it = iter(dl)
        batch = next(it)
        batch = next(it)
        report(it)
        """
        proc, _ = _run(body, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip() == "", proc.stderr[-3000:]
    assert _gone(_pids(proc.stdout)) == []


def test_the_exit_hook_leaves_no_in_process_worker_thread_running(tmp_path):
    """``num_workers=0`` reads on a thread, which cannot be terminated. The exit hook stopped it
    without waiting, so it went on through its queued tasks (inside torch) while the interpreter
    tore down: about 1 exit in 4 of such a script then aborted ("terminate called without an
    active exception", SIGABRT). Now queued tasks are dropped and the thread is joined."""
    body = """
    import threading, time
    from stallfree.loader import dataloader, pool as engine

    class Slow(Numbers):
        def __getitem__(self, i):
            time.sleep(0.02)
            return super().__getitem__(i)

    dl = DataLoader(Slow(400), batch_size=8, shuffle=True, num_workers=0)
    it = iter(dl)
    batch = next(it)
    dataloader._close_all_at_exit()
    engine._shutdown_all_at_exit()
    alive = [t.name for t in threading.enumerate() if t.name.startswith(("stallfree", "fetch"))]
    print("ALIVE", alive, flush=True)
    """
    proc, _ = _run(body, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ALIVE []" in proc.stdout, proc.stdout


def test_a_sigterm_at_a_workers_birth_never_runs_the_trainers_handler():
    """A SIGTERM that reaches a forked worker before it has reset its handler (here: sent in the
    child right after the fork) ends the worker; it does not run the training process's Python
    handler there (Ray's raises ``SystemExit``, which unwound a copy of the trainer's stack)."""
    script = textwrap.dedent(
        """
        import os, signal
        from stallfree import DataLoader
        from stallfree.loader.errors import WorkerDiedError

        parent = os.getpid()

        def trainers_handler(signum, frame):
            if os.getpid() != parent:
                os.write(1, b"HANDLER RAN IN A WORKER\\n")
            raise SystemExit(3)

        signal.signal(signal.SIGTERM, trainers_handler)
        os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM))
        try:
            list(DataLoader(list(range(8)), batch_size=2, num_workers=1))
        except WorkerDiedError as exc:
            print("DIED", exc)
        """
    )
    proc = run_python(script, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HANDLER RAN" not in proc.stdout
    assert "DIED DataLoader worker" in proc.stdout and "exit code -15" in proc.stdout, proc.stdout


def test_a_worker_forked_while_a_thread_first_resolves_a_host_can_still_resolve():
    """``getaddrinfo`` imports the idna codec on a process's first connection by name. A thread
    of the main process inside that import when a worker forked left its import lock held in the
    worker, and the worker's own first connection waited for ever (seen with S3 staging). Here
    that thread is parked inside the import (a finder that never returns), the loader forks, and
    every worker resolves a host."""
    script = textwrap.dedent(
        """
        import socket, sys, threading
        from stallfree import DataLoader

        class ParkImportOfIdna:
            def find_spec(self, name, path=None, target=None):
                if name == "encodings.idna":
                    threading.Event().wait()  # holds the module's import lock for ever
                return None

        sys.meta_path.insert(0, ParkImportOfIdna())
        first = threading.Thread(target=lambda: "example".encode("idna"), daemon=True)
        first.start()
        first.join(2.0)

        class Resolving:
            def __len__(self):
                return 4

            def __getitem__(self, i):
                socket.getaddrinfo("127.0.0.1", 80)
                return i

        print([b.tolist() for b in DataLoader(Resolving(), batch_size=2, num_workers=2, timeout=20)])
        """
    )
    proc = run_python(script, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[[0, 1], [2, 3]]"

"""A forked child never keeps the staging area's locks (storage/staging.py ``_Held``).

A ``flock`` belongs to the open file description, which a forked child shares. A loader worker
forked while the main process was fetching a shard kept that shard's fetch lock after the main
process released it, and the other worker waited on it until the loader gave up (300 s). Each
case runs in its own process with a timeout: a lock kept is a failed test, never a hung suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

TIMEOUT = 60

_FETCH_WHILE_FORKED = textwrap.dedent(
    """
    import os, sys, threading, time
    from stallfree.storage.staging import StagingArea

    root = sys.argv[1]
    area = StagingArea(root, 1 << 30)
    go, holding = threading.Event(), threading.Event()

    def fill(f):
        holding.set()
        go.wait()
        f.write(b"from the fetcher")

    fetch = threading.Thread(target=lambda: area.stage("ns", "x", fill, size=16).close())
    fetch.start()
    holding.wait()                     # the fetch lock is held now
    child = os.fork()                  # a worker, forked meanwhile; it lives on
    if child == 0:
        time.sleep(40)
        os._exit(0)
    waiter = __import__("subprocess").Popen(
        [sys.executable, "-c",
         "import sys; from stallfree.storage.staging import StagingArea; "
         "f = StagingArea(sys.argv[1], 1 << 30).stage('ns', 'x', produce=lambda: b'again'); "
         "print(open(f.path, 'rb').read().decode())",
         root],
        stdout=__import__("subprocess").PIPE, text=True)
    time.sleep(0.5)                    # the waiter blocks on the fetch lock
    go.set()
    fetch.join()
    try:
        out, _ = waiter.communicate(timeout=15)
        print("waiter got:", out.strip())
    except __import__("subprocess").TimeoutExpired:
        waiter.kill()
        print("waiter still blocked while the forked child lives")
    os.kill(child, 9)
    """
)


def _last_line(script: str, root) -> str:
    """Run ``script`` in a fresh process (a hang fails the test) and return its last line."""
    r = subprocess.run(
        [sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_a_fetch_lock_is_released_though_a_worker_was_forked_while_it_was_held(tmp_path):
    assert _last_line(_FETCH_WHILE_FORKED, tmp_path / "stage") == "waiter got: from the fetcher"


_PIN_WHILE_FORKED = textwrap.dedent(
    """
    import os, sys, time
    from stallfree.storage.staging import StagingArea, _evict

    area = StagingArea(sys.argv[1], 1 << 30)
    pin = area.stage("ns", "y", produce=lambda: b"y" * 100)
    path = pin.path
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(w, b"up")             # after the fork's handlers ran: the child's copies closed
        time.sleep(40)
        os._exit(0)
    os.read(r, 2)
    pin.close()                        # the parent is done with it: evictable now
    print("evicted" if _evict(path) else "still pinned by the forked child")
    os.kill(child, 9)
    """
)


def test_a_pin_released_by_the_parent_is_not_kept_by_a_forked_child(tmp_path):
    assert _last_line(_PIN_WHILE_FORKED, tmp_path / "stage") == "evicted"


_FORK_WHILE_A_READ_LOCK_IS_HELD = textwrap.dedent(
    """
    import os, signal, socket, threading, time
    from stallfree.storage import file_copy, remote, s3direct

    # what another thread of the parent holds at the moment of the fork: the deadline watchdog's
    # lock (its thread holds it between waits) and the two module locks of the read path
    locks = [s3direct._WATCHDOG._cond, file_copy._ROUTES_LOCK, remote._FS_TIMEOUTS_LOCK]
    held, release = threading.Event(), threading.Event()

    def hold():
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in locks:
            lock.release()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    child = os.fork()
    if child == 0:                     # a loader worker's first staged part, then its reads
        signal.alarm(20)               # a hung child ends (exit -14) rather than outlive the test
        a, b = socket.socketpair()
        token = s3direct._WATCHDOG.watch(a, time.monotonic() + 60)
        s3direct._WATCHDOG.release(token)
        with file_copy._ROUTES_LOCK, remote._FS_TIMEOUTS_LOCK:
            pass
        os._exit(0)
    release.set()
    _, status = os.waitpid(child, 0)
    print("child exited", os.waitstatus_to_exitcode(status))
    """
)


def test_a_worker_forked_while_a_read_path_lock_is_held_does_not_hang(tmp_path):
    """The deadline watchdog's lock, held by its thread in the parent at the fork, stayed locked
    in the child: a loader worker's first staged part hung in ``watch`` (a loader over S3 with
    staging and workers hung in about one run of three)."""
    assert _last_line(_FORK_WHILE_A_READ_LOCK_IS_HELD, tmp_path) == "child exited 0"

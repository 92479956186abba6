"""``run_python(code, *args)``: what ``subprocess.run([sys.executable, "-c", code, *args])`` gives,
without a fresh interpreter importing torch again for every child.

Many tests run a script in a child process (a fault must kill that process, not the session; exit
paths and leaked workers are only visible from outside). Importing torch is most of such a child's
cost: about 1.7 CPU-s of ~2. Here one interpreter per test process (the zygote) imports torch,
numpy, psutil and stallfree once, then forks one child per run. The forked child is what the
``python -c`` child is once those imports are done: a session of its own; its own stdin (empty),
stdout, stderr, argv, environment, working directory and a fresh ``__main__``; it leaves through the
interpreter's normal exit (``SystemExit``, or its uncaught exception with the traceback on stderr,
exit code 1), atexit handlers and finalisation included. A test whose point is what a fresh
interpreter imports must not use it. Children whose environments differ in a variable read at
interpreter or library start-up (``PYTHON*``, ``OMP_*``, ...) fork from different zygotes, each
started with that environment. ``preload=("lightning",)`` asks for a zygote that imported those
modules too (a framework that costs seconds to import, for tests that run several children of it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("numpy", "psutil", "torch", "stallfree", "stallfree.loader.dataloader")
# variables read when an interpreter or a preloaded library starts: a child that sets them otherwise
# than the zygote's environment does runs in a fresh interpreter
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "CUDA", "LD_", "MALLOC")

# ``run_python(AS_SCRIPT, PATH, *args)`` runs ``python PATH args...``: argv, sys.path[0] (the
# script's folder) and ``__main__`` as that command sets them
AS_SCRIPT = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# ``run_python(AS_MODULE, NAME, *args)`` runs ``python -m NAME args...``: argv[0] is the module's
# file and ``__main__`` the module (so a spawned child re-imports it as ``-m`` children do)
AS_MODULE = """
import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


class Child:
    """A child forked by ``start_python``: ``wait`` for its exit code, ``kill_session``, then
    ``output`` (its stdout and stderr; once, it removes their files)."""

    def __init__(
        self, code: str, args: tuple[str, ...], cwd: str, env: dict[str, str], preload: tuple[str, ...] = ()
    ) -> None:
        self.zygote = _zygote(env, preload)
        self.paths = []
        for name in ("out", "err"):
            fd, path = tempfile.mkstemp(prefix=f"zygote-{name}-")
            os.close(fd)
            self.paths.append(path)
        request = dict(
            op="run", code=code, argv=list(args), cwd=cwd, env=env, out=self.paths[0], err=self.paths[1]
        )
        self.pid: int = self.zygote.ask(**request)["pid"]
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code as ``subprocess`` gives it (negative: the signal); None if it still runs
        after ``timeout`` s."""
        if self.returncode is None:
            self.returncode = self.zygote.ask(op="wait", pid=self.pid, timeout=timeout)["rc"]
        return self.returncode

    def kill_session(self) -> None:
        """SIGKILL every process of its session (it leads one), and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.wait()

    def output(self) -> tuple[str, str]:
        texts = []
        for path in self.paths:
            texts.append(Path(path).read_text(errors="replace"))
            os.unlink(path)
        return texts[0], texts[1]


def start_python(
    code: str,
    *args: str,
    cwd: str | os.PathLike | None = None,
    env: typing.Mapping[str, str] | None = None,
    preload: typing.Sequence[str] = (),
) -> Child:
    """``python -c code args...`` forked from this process's zygote, in a session of its own, its
    stdout and stderr captured; from a zygote that also imported ``preload`` when given."""
    env = dict(os.environ if env is None else env)
    return Child(code, args, str(cwd if cwd is not None else os.getcwd()), env, tuple(preload))


def run_python(
    code: str,
    *args: str,
    cwd: str | os.PathLike | None = None,
    env: typing.Mapping[str, str] | None = None,
    timeout: float | None = None,
    preload: typing.Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, ...)``,
    forked from this process's zygote; on ``timeout`` the child's session is killed and
    ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    cmd = [sys.executable, "-c", code, *args]
    child = start_python(code, *args, cwd=cwd, env=env, preload=preload)
    try:
        rc = child.wait(timeout)
        if rc is None:
            child.kill_session()
    finally:
        out, err = child.output()
    if rc is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def run_ranks(
    code: str, world: int, *args: str, timeout: float, cwd: str | os.PathLike | None = None
) -> None:
    """``python -c code RANK WORLD args...`` for every rank of ``world`` at once (ranks that meet in
    a process group), forked from the zygote; a rank that exits non-zero, or still runs after
    ``timeout`` s (a bound on a hang), fails the test with its stderr; every rank's session is
    killed on the way out."""
    ranks = [start_python(code, str(rank), str(world), *args, cwd=cwd) for rank in range(world)]
    try:
        deadline = time.monotonic() + timeout
        for rank, child in enumerate(ranks):
            rc = child.wait(max(0.0, deadline - time.monotonic()))
            assert rc == 0, f"rank {rank} of {world}: exit {rc}\n{child.output()[1][-3000:]}"
    finally:
        for child in ranks:
            if child.returncode is None:
                child.kill_session()
            with contextlib.suppress(FileNotFoundError):
                child.output()


def _startup_env(env: typing.Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)))


class _Zygote:
    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests import zygote; zygote._serve()", *preload],
            cwd=ROOT,
            env=env,  # imports tests.zygote from its working directory, the repository root ('' on sys.path)
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def ask(self, **request: typing.Any) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test zygote exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_zygotes: dict[tuple, _Zygote] = {}


def _zygote(env: dict[str, str], preload: tuple[str, ...] = ()) -> _Zygote:
    """This process's zygote for ``env``'s start-up variables (``PYTHONPATH``, ``OMP_NUM_THREADS``,
    ...) and the extra modules ``preload``, started on first use (again if it died); closed at exit."""
    key = (_startup_env(env), preload)
    if key not in _zygotes or _zygotes[key].proc.poll() is not None:
        if not _zygotes:
            atexit.register(_close)
        _zygotes[key] = _Zygote(env, preload)
    return _zygotes[key]


def _close() -> None:
    while _zygotes:
        _zygotes.popitem()[1].close()


# --- the zygote's side ---


def _serve() -> None:
    """Serve requests on stdin, one JSON line each, one JSON reply line each on stdout, until EOF;
    ``PRELOAD`` and the modules named in ``sys.argv[1:]`` imported first.

    ``{"op": "run", "code", "argv", "cwd", "env", "out", "err"}`` forks a child; reply ``{"pid"}``.
    ``{"op": "wait", "pid", "timeout"}`` reaps it; reply ``{"rc"}``: its exit code as ``subprocess``
    gives it (negative: the signal), or None if it still runs after ``timeout`` s."""
    import importlib

    for name in (*PRELOAD, *sys.argv[1:]):
        importlib.import_module(name)
    # the preloaded objects out of the collector's reach: a child's collections and its exit no
    # longer walk (and so copy, page by page) every object torch made here (0.45 -> ~0.15 CPU-s
    # for a child that runs ``pass``)
    gc.collect()
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "run":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)  # never returns: the child leaves through the interpreter's exit
            reply: dict = {"pid": pid}
        else:
            reply = {"rc": _wait(request["pid"], request["timeout"])}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _child(request: dict) -> None:
    """In the forked child: become ``python -c CODE ARGV...`` and run CODE in a fresh ``__main__``."""
    import builtins
    import types

    os.setsid()
    for fd, path in ((1, request["out"]), (2, request["err"])):
        opened = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the zygote's request pipe is not the child's
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is this run's
    sys.argv = ["-c", *request["argv"]]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(request["code"], "<string>", "exec"), main.__dict__)  # noqa: S102 - the test's own script
    raise SystemExit(0)


def _wait(pid: int, timeout: float | None) -> int | None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)

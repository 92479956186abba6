"""Start and stop a local ``redis-server`` configured as a cache node (used by the CLI and tests).

The configuration is written to a private (0600) file, so a password never appears on a command
line: loopback only unless told otherwise, no persistence (a cache is rebuilt from storage),
``maxmemory`` from the capacity and the eviction policy from the cache policy.

Clients get only the data commands the cache needs (``DATA_COMMANDS``), through Redis ACLs: the
``default`` user, which every client authenticates as with the cache password, cannot FLUSHALL,
CONFIG SET (lift ``maxmemory``), DEBUG, MODULE LOAD, SHUTDOWN or change ACLs, so a leaked cache
password costs cached samples, not the server. Administration goes through a separate user
(``ADMIN_USER``) whose random password is written to ``workdir/admin.password`` (0600).

On Linux the server is tied to the process that started it (``PR_SET_PDEATHSIG``): when that process dies,
even by SIGKILL, the kernel kills the server too, so no orphan keeps the port and the memory.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stallfree.cache.policy import Policy, get_policy

log = logging.getLogger(__name__)

# What ClusterCache and ``stallfree cache stats`` send, and nothing else: connection set-up
# (redis-py may send HELLO; its CLIENT SETINFO, unknown before Redis 7.2, is refused and ignored), the
# data path (GET/MGET/SET/EXISTS, and FCALL of the functions the admin loaded at start, whose
# redis.call()s are checked against the same list), and read-only INFO and DBSIZE for stats. Never
# EVAL, SCRIPT or FUNCTION: a client that may send Lua text may run any loop or allocation on the
# server (redis_functions.py). Keep it in step with cache/redis_ops.py and cache/cluster.py.
DATA_COMMANDS = (
    "ping", "auth", "hello", "client|setname", "quit", "reset", "select",
    "get", "mget", "set", "exists", "strlen", "del", "decrby", "incrby",
    "fcall", "fcall_ro", "info", "dbsize",
)  # fmt: skip
ADMIN_USER = "stallfree-admin"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """``"8GB"`` -> 8_000_000_000, ``"512MiB"`` -> 536_870_912; a clear ``ValueError`` otherwise."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; use e.g. 8GB, 512MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the OS picks it; an IPv6 host gets an IPv6 socket:
    ``--bind ::1 --port 0`` was a ``socket.gaierror`` traceback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process acting as a cache node; a context manager.

    ``capacity_bytes`` becomes ``maxmemory`` (``None``: unlimited) and ``policy`` its
    ``maxmemory-policy`` (minio -> noeviction, lru -> allkeys-lru). On Linux the server dies with
    the *thread* that started it (the kernel's parent-death signal follows the forking thread), so
    start it from the main thread or another that lives as long as the server should.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        bind: str = "127.0.0.1",
        capacity_bytes: int | None = None,
        policy: str | Policy = "minio",
        password: str | None = None,
        workdir: str | os.PathLike | None = None,
        executable: str = "redis-server",
        tls_cert_file: str | os.PathLike | None = None,
        tls_key_file: str | os.PathLike | None = None,
        tls_ca_cert_file: str | os.PathLike | None = None,
        restricted: bool = True,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:  # Redis reads maxmemory 0 as "no limit"
            raise ValueError(f"capacity must be more than 0 bytes (None: no limit), got {capacity_bytes}")
        if port is not None and not 0 <= port <= 65535:  # else redis-server's own config error
            raise ValueError(f"port must be from 0 to 65535 (0: any free port), got {port}")
        self.bind = _check_bind(bind)
        self.restricted = restricted  # clients may run DATA_COMMANDS only (see the module docstring)
        self.admin_password: str | None = None
        self.port = port or free_port(self.host)
        # a port chosen here may be taken by another process before the server binds it (seen in
        # the test suite: "bind: Address already in use"); then the first start picks another
        self._repick_port = not port
        self.capacity_bytes = capacity_bytes
        self.policy = get_policy(policy)
        self.password = password
        self._own_workdir = workdir is None
        self.workdir = (
            Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="stallfree-redis-"))
        )
        self.executable = shutil.which(executable) or executable
        self.process: subprocess.Popen | None = None
        self.tls_cert_file = tls_cert_file
        self.tls_key_file = tls_key_file
        self.tls_ca_cert_file = tls_ca_cert_file
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def host(self) -> str:
        """Where a client on this machine reaches the server (loopback for a wildcard bind)."""
        return "127.0.0.1" if self.bind in ("0.0.0.0", "::") else self.bind

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"{'rediss' if self.tls else 'redis'}://{host}:{self.port}"

    @property
    def logfile(self) -> Path:
        return self.workdir / "redis.log"

    def config_text(self) -> str:
        if self.tls:
            listen = [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {self.tls_cert_file}",
                f"tls-key-file {self.tls_key_file}",
            ]
            if self.tls_ca_cert_file is not None:  # clients may then present certificates it signed
                listen += [f"tls-ca-cert-file {self.tls_ca_cert_file}", "tls-auth-clients optional"]
            else:
                listen.append("tls-auth-clients no")
        else:
            listen = [f"port {self.port}"]
        lines = [
            *listen,
            f"bind {self.bind}",
            "protected-mode yes",
            "daemonize no",
            'save ""',
            "appendonly no",
            f"dir {self.workdir}",
            f"logfile {self.logfile}",
            f"maxmemory {self.capacity_bytes or 0}",
            f"maxmemory-policy {self.policy.redis_maxmemory_policy}",
            "maxmemory-samples 10",
            "lazyfree-lazy-eviction yes",
        ]
        if not self.restricted:
            if self.password:
                lines.append(f'requirepass "{_quote(self.password)}"')
            return "\n".join(lines) + "\n"
        auth = f'">{_quote(self.password)}"' if self.password else "nopass"
        allowed = " ".join(f"+{c}" for c in DATA_COMMANDS)
        lines += [
            f"user default reset on {auth} ~* resetchannels -@all {allowed}",
            f'user {ADMIN_USER} reset on ">{_quote(self.admin_password or "")}" ~* &* +@all',
        ]
        return "\n".join(lines) + "\n"

    @property
    def admin_password_file(self) -> Path:
        return self.workdir / "admin.password"

    def _write_admin_password(self) -> None:
        """A fresh random admin password in ``admin_password_file`` (0600), unless one is set."""
        if self.admin_password is None:
            self.admin_password = secrets.token_urlsafe(24)
        fd = os.open(self.admin_password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_password + "\n")

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING; raises ``RuntimeError`` with its log."""
        if self.process is not None and self.process.poll() is None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.restricted:
            self._write_admin_password()
        conf = self.workdir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config_text())
        log_start = self.logfile.stat().st_size if self.logfile.exists() else 0  # a restart appends
        self.process = subprocess.Popen(
            [self.executable, str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent(),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                if self._repick_port and "Address already in use" in err + self._log_tail():
                    log.info("port %d was taken before redis-server bound it: picking another", self.port)
                    self._repick_port = False  # once: a second loss is reported
                    self.port = free_port(self.host)
                    self.process = None
                    return self.start(timeout_s)
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}: {err}{self._log_tail()}"
                )
            # another process may answer on the port (ours then fails to bind): wait for our own log
            if self._ping() and self._logged_ready(log_start):
                log.info("redis-server up at %s (pid %d)", self.url, self.process.pid)
                self._repick_port = False  # a restart keeps its URL
                self._load_functions()
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer within {timeout_s}s{self._log_tail()}"
        )

    def _load_functions(self) -> None:
        """Load the cache's server-side functions as the admin (restricted) or the default user:
        clients may call them, never send Lua of their own (``redis_functions.py``)."""
        from stallfree.cache import redis_functions
        from stallfree.cache.redis_ops import connect

        kwargs: dict = {"host": self.host, "port": self.port, "socket_timeout": 10.0}
        if self.restricted:
            kwargs.update(username=ADMIN_USER, password=self.admin_password)
        elif self.password:
            kwargs["password"] = self.password
        if self.tls:  # our own server on our own socket: its identity is the clients' to check
            kwargs.update(ssl=True, ssl_cert_reqs="none", ssl_check_hostname=False)
        client = connect(kwargs)
        try:
            redis_functions.load(client)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"could not load the cache functions into redis-server: {exc}") from exc
        finally:
            client.close()

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), 0.2) as raw:
                sock = raw
                if self.tls:  # readiness only: checking the server's identity is the client's job
                    ctx = ssl.create_default_context()
                    ctx.check_hostname = False
                    ctx.verify_mode = ssl.CERT_NONE
                    sock = ctx.wrap_socket(raw)
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
            return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
        except OSError:
            return False

    def _logged_ready(self, since: int) -> bool:
        try:
            with open(self.logfile, "rb") as f:
                f.seek(since)
                return b"Ready to accept connections" in f.read()
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return "\n" + "\n".join(self.logfile.read_text(errors="replace").splitlines()[-10:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests); the data is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.process.stderr is not None:
            self.process.stderr.close()

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def wait(self) -> int:
        """Block until the server exits (``stallfree cache serve`` runs in the foreground)."""
        return self.process.wait() if self.process is not None else 0

    def cleanup(self) -> None:
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGKILL the child when its parent dies (Linux only;
    ``None`` elsewhere). It runs between fork and exec, so it only calls the resolved ``prctl``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.debug("prctl unavailable; redis-server will outlive a killed parent")
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec


def _check_bind(bind: str) -> str:
    """``bind`` if this machine can listen there; a ``ValueError`` naming it otherwise (an address
    that is no address, or not one of this machine's), before any server or port is touched.
    redis-server binds IP addresses, so a name other than localhost is refused unresolved."""
    if bind == "localhost":
        bind = "127.0.0.1"
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(bind).version == 6 else socket.AF_INET
    except ValueError:
        raise ValueError(f"cannot listen on {bind!r}: not an IP address") from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bind, 0))
    except OSError as exc:
        raise ValueError(f"cannot listen on {bind!r}: {exc.strerror or exc}") from None
    return bind


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')

"""``stallfree cache serve`` (run this node's Redis cache server) and ``stallfree cache stats``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from stallfree.cli._common import fail

_PASSWORD_ENV = "STALLFREE_CACHE_PASSWORD"
_PASSWORD_FILE_ENV = "STALLFREE_CACHE_PASSWORD_FILE"
_SECRET_FILE_ENV = "STALLFREE_CACHE_SECRET_FILE"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache",
        help="run or inspect the cluster cache (one Redis server per node)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  stallfree cache serve --capacity 64GB --policy minio --port 6380\n"
            "  stallfree cache stats redis://node1:6380 redis://node2:6380 --json"
        ),
    )
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION")

    serve = csub.add_parser(
        "serve",
        help="start a Redis cache server for this node (foreground; Ctrl-C stops it)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example:\n  stallfree cache serve --capacity 8GB --policy minio --port 6380 \\\n"
            "      --password-file ~/.stallfree/cache.password --secret-file ~/.stallfree/cache.secret\n\n"
            "Without --password/--password-file the server gets a random password, written to a\n"
            "private (0600) file in its working directory; the path is printed. Clients read it with\n"
            f"--password-file, ${_PASSWORD_FILE_ENV} or ClusterCache(password_file=...).\n"
            f"The password may also come from ${_PASSWORD_ENV} (kept off the process list).\n"
            "--secret-file creates (once) the secret clients sign entries with: ClusterCache(secret_file=...).\n"
            "Binds to 127.0.0.1 unless --bind says otherwise; no persistence (a cache refills from storage)."
        ),
    )
    serve.add_argument("--port", type=int, default=6380, help="TCP port (default 6380; 0 = any free port)")
    serve.add_argument(
        "--capacity",
        default="8GB",
        help="memory limit of the server (maxmemory), e.g. 64GB, 512MiB (default 8GB)",
    )
    serve.add_argument(
        "--policy", choices=["minio", "lru"], default="minio", help="admission policy (default minio)"
    )
    serve.add_argument(
        "--password", default=None, help=f"require this password (AUTH); or set ${_PASSWORD_ENV}"
    )
    serve.add_argument(
        "--password-file",
        default=None,
        help=f"require the password in this file, creating it (random, 0600) if missing; or ${_PASSWORD_FILE_ENV}",
    )
    serve.add_argument(
        "--no-password", action="store_true", help="no password: any process that reaches the port may use it"
    )
    serve.add_argument(
        "--secret-file",
        default=None,
        help=f"create (if missing) the entry-signing secret clients share, 0600; or ${_SECRET_FILE_ENV}",
    )
    serve.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--dir", default=None, help="working directory for the server's config and log")
    serve.add_argument(
        "--tls-cert", default=None, help="serve TLS only (rediss://) with this certificate (PEM)"
    )
    serve.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    serve.add_argument("--tls-ca", default=None, help="CA certificate for verifying client certificates")
    serve.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    serve.set_defaults(func=run_serve)

    stats = csub.add_parser(
        "stats",
        help="per-server usage and hit rates",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree cache stats redis://127.0.0.1:6380 --json",
    )
    stats.add_argument("--tls-ca", default=None, help="CA certificate to verify rediss:// servers")
    stats.add_argument("urls", nargs="+", metavar="URL", help="cache servers, redis://host:port")
    stats.add_argument("--password", default=None, help=f"server password; or set ${_PASSWORD_ENV}")
    stats.add_argument(
        "--password-file", default=None, help=f"file holding the password; or set ${_PASSWORD_FILE_ENV}"
    )
    stats.add_argument(
        "--timeout", type=float, default=2.0, help="seconds to wait for each server (default 2)"
    )
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(func=run_stats)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _password_source(args: argparse.Namespace) -> tuple[str | None, Path | None]:
    """(password, password file): ``--password``, else ``--password-file``, else
    ``$STALLFREE_CACHE_PASSWORD`` (kept off the process list), else ``$STALLFREE_CACHE_PASSWORD_FILE``.
    Raises ValueError when a value and a file are both given as options."""
    if args.password and args.password_file:
        raise ValueError("--password and --password-file exclude each other")
    if args.password or args.password_file:
        return args.password or None, Path(args.password_file).expanduser() if args.password_file else None
    env_file = os.environ.get(_PASSWORD_FILE_ENV)
    return os.environ.get(_PASSWORD_ENV) or None, Path(env_file).expanduser() if env_file else None


def _serve_password(args: argparse.Namespace, workdir: Path) -> tuple[str | None, Path | None]:
    """The server's password and the file clients read it from (created when missing); a fresh
    random one in ``workdir/password`` unless told otherwise; none with ``--no-password``."""
    from stallfree.cache.credentials import ensure_secret_file

    password, path = _password_source(args)
    if args.no_password:
        if args.password or args.password_file:
            raise ValueError("--no-password excludes --password and --password-file")
        return None, None
    if password:
        return password, None
    path = path or workdir / "password"
    return ensure_secret_file(path, "password")[0], path


def run_serve(args: argparse.Namespace) -> int:
    from stallfree.cache.credentials import CredentialFileError, ensure_secret_file
    from stallfree.cache.server import ADMIN_USER, RedisServer, parse_size

    try:
        capacity = parse_size(args.capacity)
    except ValueError as exc:
        return fail("cache serve", exc, 2)
    if capacity <= 0:  # Redis would read maxmemory 0 as "no limit"
        return fail("cache serve", f"--capacity must be more than 0, got {args.capacity!r}", 2)
    if (args.tls_cert is None) != (args.tls_key is None):
        return fail("cache serve", "--tls-cert and --tls-key go together", 2)
    try:
        server = RedisServer(
            args.port or None,
            bind=args.bind,
            capacity_bytes=capacity,
            policy=args.policy,
            workdir=args.dir,
            executable=args.redis_server,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_ca_cert_file=args.tls_ca,
        )
    except ValueError as exc:  # e.g. --bind names no address of this machine
        return fail("cache serve", exc, 2)
    secret_file = args.secret_file or os.environ.get(_SECRET_FILE_ENV)
    try:
        server.password, password_file = _serve_password(args, server.workdir)
        if secret_file:
            secret_file = Path(secret_file).expanduser()
            ensure_secret_file(secret_file, "secret")
    except CredentialFileError as exc:
        server.cleanup()
        return fail("cache serve", exc)
    except ValueError as exc:
        server.cleanup()
        return fail("cache serve", exc, 2)
    if args.bind not in ("127.0.0.1", "localhost", "::1") and not server.password:
        print(
            f"warning: listening on {args.bind} without a password; anyone who can reach it can read the cache",
            file=sys.stderr,
        )
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        server.cleanup()
        return fail("cache serve", f"could not start redis-server: {exc}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the server on SIGTERM too
    print(server.url, flush=True)
    print(
        f"serving {args.policy} cache of {args.capacity} at {server.url} (pid {server.process.pid}); Ctrl-C stops it",
        file=sys.stderr,
        flush=True,
    )
    if password_file is not None:
        print(
            f"password file: {password_file} (clients: --password-file, ${_PASSWORD_FILE_ENV} "
            "or ClusterCache(password_file=...))",
            file=sys.stderr,
            flush=True,
        )
    elif not server.password:
        print("warning: no password; any local process can read and write this cache", file=sys.stderr)
    print(
        f"clients may run data commands only (no FLUSHALL, CONFIG, DEBUG, MODULE); admin user "
        f"{ADMIN_USER}, password in {server.admin_password_file}",
        file=sys.stderr,
        flush=True,
    )
    if secret_file:
        print(
            f"secret file: {secret_file} (clients: ClusterCache(secret_file=...))",
            file=sys.stderr,
            flush=True,
        )
    try:
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.cleanup()


def run_stats(args: argparse.Namespace) -> int:
    from stallfree.cache.cluster import ClusterCacheError, server_status
    from stallfree.cache.credentials import read_secret_file

    try:
        password, path = _password_source(args)
        if password is None and path is not None:
            password = read_secret_file(path, "password")
    except ValueError as exc:  # CredentialFileError is one
        return fail("cache stats", exc, 2)
    rows, failed = [], 0
    for url in args.urls:
        try:
            rows.append(
                server_status(url, password=password, timeout_s=args.timeout, tls_ca_certs=args.tls_ca)
            )
        except (ClusterCacheError, ValueError) as exc:
            rows.append({"url": url, "error": str(exc)})
            failed += 1
    if args.json:
        print(json.dumps(rows, indent=2))
        return 1 if failed else 0
    print(
        f"{'server':<28} {'policy':<12} {'keys':>9} {'used':>10} {'max':>10} {'cached':>10} {'hit rate':>8} {'evicted':>8}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['url']:<28} unreachable: {row['error']}")
            continue
        cached = _human(row["cached_bytes"]) if row["cached_bytes"] is not None else "-"
        print(
            f"{row['url']:<28} {row['policy']:<12} {row['keys']:>9} {_human(row['used_memory']):>10} "
            f"{(_human(row['maxmemory']) if row['maxmemory'] else 'none'):>10} {cached:>10} "
            f"{row['hit_rate']:>8.1%} {row['evicted_keys']:>8}"
        )
    return 1 if failed else 0


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return str(n)

"""Where ``stallfree shard`` runs its shard tasks: ``--engine local|ray[:ADDRESS]|spark[:MASTER]``.

The sharding job (``stallfree/shards/parallel.py`` ``shard_dataset``) makes the plan, the shard
names and the manifest on the driver and hands the tasks to a runner (its ``TaskRunner``
protocol). This module is that seam's engine side: ``ShardExecutor`` (a runner that can also say
which machines it runs on and be closed), the registry of engines (one line each, one file per
engine, imported only when named), the local executor (today's ``--workers``), and the rule that
keeps a cluster from writing to a path that exists only on this machine.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import logging
import posixpath
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec

from stallfree.errors import WriteError
from stallfree.shards.parallel import (
    LocalRunner,
    ProgressFn,
    ShardJob,
    ShardResult,
    ShardTask,
    source_locations,
)

log = logging.getLogger(__name__)

# name -> "module:factory"; a factory takes (address or None, workers=) and returns a ShardExecutor
ENGINES: dict[str, str] = {
    "local": "stallfree.engines.executor:LocalExecutor",
    "ray": "stallfree.engines.ray_shard:RayExecutor",
    "spark": "stallfree.engines.spark:SparkExecutor",
}
# Filesystems whose paths name something on one machine (or in one process) only.
_MACHINE_LOCAL = {"file", "local"}
_PROCESS_LOCAL = {"memory"}


class UnreachablePathError(WriteError):
    """A cluster engine was given a path its tasks cannot reach (a local path while some node is
    another machine, or ``memory://``, which lives in one process)."""


class ShardTaskError(WriteError):
    """A shard task failed on the engine after the engine's retries; ``shard`` names its file."""


@dataclass(frozen=True)
class EngineSpec:
    """``--engine NAME[:ADDRESS]``: ``ray:auto``, ``ray:10.0.0.1:6379``, ``spark:local[4]``,
    ``spark:spark://host:7077``. ``address`` None: the engine's default (Ray: a running cluster
    or a new local one; Spark: the active session or ``local[*]``)."""

    name: str
    address: str | None = None

    def __str__(self) -> str:
        return self.name if self.address is None else f"{self.name}:{self.address}"


def parse_engine(text: str) -> EngineSpec:
    """``local``, ``ray``, ``ray:ADDRESS``, ``spark``, ``spark:MASTER`` (split at the first
    colon: a Spark master URL keeps its own). ValueError naming the engines otherwise."""
    name, sep, address = text.partition(":")
    name = name.strip().lower()
    if name not in ENGINES:
        raise ValueError(f"unknown engine {text!r}: choose {', '.join(sorted(ENGINES))}")
    if sep and not address:
        raise ValueError(f"engine {text!r}: give an address after ':' or leave the ':' out")
    if name == "local" and sep:
        raise ValueError("the local engine takes no address (use --workers N)")
    return EngineSpec(name, address or None)


class ShardExecutor(Protocol):
    """A runner for ``shard_dataset(executor=...)`` made by ``make_executor``. ``remote``: tasks
    run outside this process tree. ``nodes()``: the addresses of the machines tasks may run on
    (empty: this machine only). ``close()`` stops what the executor started (not a session or
    cluster it was given)."""

    name: str
    remote: bool

    def nodes(self) -> list[str]: ...

    def prepare(self, job: ShardJob) -> None: ...

    def run(
        self,
        job: ShardJob,
        tasks: Sequence[ShardTask],
        on_result: Callable[[ShardResult], None],
        progress: ProgressFn | None,
    ) -> None: ...

    def close(self) -> None: ...


class LocalExecutor(LocalRunner):
    """Today's ``--workers N``: forked processes on this machine (one: in this process)."""

    name = "local"

    def __init__(self, address: str | None = None, *, workers: int = 1) -> None:
        if address is not None:
            raise ValueError("the local engine takes no address")
        super().__init__(workers=workers)

    def nodes(self) -> list[str]:
        return []

    def close(self) -> None:
        pass

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_executor(engine: str | EngineSpec, *, workers: int = 1, **options: Any) -> ShardExecutor:
    """The executor ``engine`` names (``parse_engine``'s syntax). The engine's module is imported
    only here, so ``--engine local`` never imports Ray or Spark; a missing one is ``MissingExtra``
    naming the extra to install."""
    spec = parse_engine(engine) if isinstance(engine, str) else engine
    module, _, factory = ENGINES[spec.name].partition(":")
    return getattr(importlib.import_module(module), factory)(spec.address, workers=workers, **options)


# -- what a cluster can reach -----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def this_machine() -> frozenset[str]:
    """Every name and address of this machine: loopback, the host name, its addresses and those
    of every network interface (psutil)."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        names |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            names |= {a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    except Exception:  # noqa: BLE001 - no interface list: the names above still count
        pass
    return frozenset(n.lower() for n in names if n)


def is_this_machine(node: str) -> bool:
    """Whether ``node`` (an address or host name, maybe with ``:port``) is this machine."""
    host = node.strip().lower()
    if host.startswith("[") and "]" in host:  # [::1]:port
        host = host[1 : host.index("]")]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in this_machine()


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    proto = fs.protocol
    return {proto} if isinstance(proto, str) else set(proto)


def check_reachable(engine: str, nodes: Iterable[str], job: ShardJob, *, shared_fs: bool = False) -> None:
    """Refuse, before anything is written, a destination or source the engine's tasks cannot
    reach: ``memory://`` always (it lives in this process); a local path when some node is
    another machine, unless ``shared_fs`` (the user says every node mounts it at the same path).
    An engine that cannot list its nodes passes one it cannot place, so local paths are refused."""
    dst_fs = fsspec.core.url_to_fs(job.dst, **job.storage_options)[0]
    places = [("destination", job.dst, dst_fs)]
    places += [("source", where, fs) for fs, where in source_locations(job.source)]
    _check_places(engine, nodes, places, shared_fs)


def check_destination_reachable(
    engine: str, nodes: Iterable[str], dst: str, storage_options: dict[str, Any], *, shared_fs: bool = False
) -> None:
    """``check_reachable`` for a destination alone (``write_spark``, ``write_ray``: the source
    is the engine's own data)."""
    fs = fsspec.core.url_to_fs(dst, **storage_options)[0]
    _check_places(engine, nodes, [("destination", dst, fs)], shared_fs)


def _check_places(
    engine: str,
    nodes: Iterable[str],
    places: list[tuple[str, str, fsspec.AbstractFileSystem]],
    shared_fs: bool,
) -> None:
    foreign = sorted(n for n in nodes if not is_this_machine(n))
    for role, shown, fs in places:
        protocols = _protocols(fs)
        if protocols & _PROCESS_LOCAL:
            raise UnreachablePathError(
                f"the {role} {shown} is in this process's memory; the {engine} engine's tasks run "
                "in other processes and cannot reach it (use a shared filesystem or an object store)"
            )
        if protocols & _MACHINE_LOCAL and foreign and not shared_fs:
            more = ", ..." if len(foreign) > 3 else ""
            raise UnreachablePathError(
                f"the {role} {shown} is a path on this machine, but the {engine} engine runs tasks "
                f"on other machines too ({', '.join(foreign[:3])}{more}): use an object store "
                "(s3://...), or a filesystem every node mounts at the same path and say so "
                "(--shared-fs; shared_fs=True)"
            )


def shard_of(task: ShardTask) -> str:
    """The file name a task writes, for messages."""
    return posixpath.basename(task.path)

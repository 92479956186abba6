"""A real Ray cluster on loopback for tests, benchmarks and examples: one head and N worker nodes,
each its own raylet and object store, every one bound to 127.0.0.1, dashboard off, usage stats off.

Use it (needs the ``ray`` extra)::

    from stallfree.testing.ray_cluster import loopback_cluster

    with loopback_cluster(worker_nodes=2, resource="stallfree_cpu") as cluster:
        # this process is connected as a driver (connect=True): ray.remote / ray.get work here
        cluster.address            # "127.0.0.1:PORT": pass it to RayWorkers(address=...) or a subprocess
        cluster.worker_nodes       # the RayNode of each worker node (node_id, address, resources)
        cluster.kill_raylet(cluster.worker_nodes[0])   # SIGKILL that node's raylet (a node dying)

or, for a pytest module-scoped fixture, ``start_loopback_cluster(...)`` and ``cluster.shutdown()``.
A subprocess driver connects with ``ray.init(address=cluster.address)`` after
``os.environ.update(LOOPBACK_ENV)`` (``cluster.env`` is the environment to give it).
Importing this module sets those variables in this process (before ``import ray`` is best).

Why the environment variables (set here, at the test edge, never by the library): Ray turns a
loopback bootstrap address into the machine's outside address when a driver connects
(``services.resolve_ip_for_localhost``), and then retries the outside address forever where
nothing listens there. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray 2.60) it keeps 127.0.0.1.
Ray reads that flag when it is imported, so this module sets it when it is imported, and
``start_loopback_cluster`` also turns it off in a Ray imported earlier (its module constant, read
at each address lookup). The node processes inherit the environment. Every node's
address is checked to be 127.0.0.1 before the cluster is handed out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

HOST = "127.0.0.1"
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 as the driver's and nodes' address
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report (there is no network anyway)
    "RAY_DEDUP_LOGS": "0",
}
DEFAULT_RESOURCE = "stallfree_cpu"
os.environ.update(LOOPBACK_ENV)  # before any ``import ray`` that follows this module's


@dataclasses.dataclass(frozen=True)
class RayNode:
    """One node of the cluster as Ray reports it."""

    node_id: str
    address: str
    resources: dict[str, float]
    is_head: bool


@dataclasses.dataclass
class LoopbackCluster:
    """A started cluster: its address, its nodes, and what a test does to them."""

    address: str
    head: RayNode
    worker_nodes: list[RayNode]
    connected: bool
    _cluster: Any  # ray.cluster_utils.Cluster
    _handles: dict[str, Any]  # node_id -> ray's node handle (its processes)

    @property
    def env(self) -> dict[str, str]:
        """The environment a subprocess driver needs (this one's, plus the loopback flags)."""
        return {**os.environ, **LOOPBACK_ENV}

    def raylet_pid(self, node: RayNode) -> int:
        """The pid of ``node``'s raylet process."""
        from ray._private import ray_constants

        handle = self._handles[node.node_id]
        return handle.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid

    def kill_raylet(self, node: RayNode) -> None:
        """SIGKILL ``node``'s raylet: the node, and every actor and object on it, is gone (Ray
        notices within its health-check period and fails their calls)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.raylet_pid(node), signal.SIGKILL)

    def add_worker_node(self, cpus: int = 1, resource: str | None = DEFAULT_RESOURCE) -> RayNode:
        """One more worker node (the same settings as the others)."""
        handle = self._cluster.add_node(**_node_args(cpus, resource, None))
        self._cluster.wait_for_nodes()
        node = _node_of(handle.node_id)
        _check_loopback([node])
        self._handles[node.node_id] = handle
        self.worker_nodes.append(node)
        return node

    def shutdown(self) -> None:
        """Disconnect this driver and stop every node (bounded; safe to call twice)."""
        import ray

        if self.connected:
            with contextlib.suppress(Exception):
                ray.shutdown()
            self.connected = False
        if self._cluster is not None:
            with contextlib.suppress(Exception):
                self._cluster.shutdown()
            self._cluster = None


def _node_args(cpus: int, resource: str | None, object_store_bytes: int | None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_cpus": cpus,
        "node_ip_address": HOST,
        "resources": {resource: float(cpus)} if resource else {},
    }
    if object_store_bytes:
        args["object_store_memory"] = object_store_bytes
    return args


def _set_env() -> None:
    """The loopback flags into this process's environment (for the node processes and any driver
    it starts), and into an already imported Ray, which read its flag at import."""
    os.environ.update(LOOPBACK_ENV)
    if "ray" in sys.modules:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # read at each call of get_node_ip_address


def _node_of(node_id: str) -> RayNode:
    import ray

    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return RayNode(
                node_id=node_id,
                address=n["NodeManagerAddress"],
                resources=dict(n["Resources"]),
                is_head="node:__internal_head__" in n["Resources"],
            )
    raise RuntimeError(f"Ray reports no node {node_id}")


def _check_loopback(nodes: list[RayNode]) -> None:
    off = [n for n in nodes if n.address != HOST]
    if off:
        raise RuntimeError(f"Ray nodes not on {HOST}: {[(n.node_id[:8], n.address) for n in off]}")


def start_loopback_cluster(
    worker_nodes: int = 2,
    cpus_per_node: int = 1,
    resource: str | None = DEFAULT_RESOURCE,
    head_cpus: int = 0,
    object_store_bytes: int | None = 128 << 20,
    connect: bool = True,
    system_config: dict[str, Any] | None = None,
) -> LoopbackCluster:
    """Start a head (``head_cpus`` CPUs, so by default nothing is scheduled on it) and
    ``worker_nodes`` nodes of ``cpus_per_node`` CPUs, each also carrying ``cpus_per_node`` units
    of the custom ``resource``. ``connect``: this process becomes a driver of it (required to read
    the nodes' addresses; disconnect with ``ray.shutdown()`` if a subprocess should be the only
    driver). ``system_config``: Ray's ``_system_config`` for the head (e.g. a short
    ``health_check_period_ms`` so a killed node is noticed in a second or two, not ~15 s).
    Raises if any node's address is not 127.0.0.1."""
    _set_env()
    import ray
    from ray.cluster_utils import Cluster

    head_args = _node_args(head_cpus, None, object_store_bytes)
    head_args["include_dashboard"] = False
    if system_config:
        head_args["_system_config"] = dict(system_config)
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    try:
        handles = [cluster.head_node] + [
            cluster.add_node(**_node_args(cpus_per_node, resource, object_store_bytes))
            for _ in range(worker_nodes)
        ]
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < len(handles):
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(ray.nodes())} of {len(handles)} Ray nodes came up in 60 s")
            time.sleep(0.1)
        nodes = [_node_of(h.node_id) for h in handles]
        _check_loopback(nodes)
        if not cluster.address.startswith(f"{HOST}:"):
            raise RuntimeError(f"the Ray head's address is {cluster.address}, not on {HOST}")
    except BaseException:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
        raise
    out = LoopbackCluster(
        address=cluster.address,
        head=nodes[0],
        worker_nodes=nodes[1:],
        connected=True,
        _cluster=cluster,
        _handles={n.node_id: h for n, h in zip(nodes, handles, strict=True)},
    )
    if not connect:
        ray.shutdown()
        out.connected = False
    return out


@contextlib.contextmanager
def loopback_cluster(
    worker_nodes: int = 2,
    cpus_per_node: int = 1,
    resource: str | None = DEFAULT_RESOURCE,
    head_cpus: int = 0,
    object_store_bytes: int | None = 128 << 20,
    connect: bool = True,
    system_config: dict[str, Any] | None = None,
) -> Iterator[LoopbackCluster]:
    """``start_loopback_cluster`` as a context manager: the cluster is shut down on exit."""
    cluster = start_loopback_cluster(
        worker_nodes, cpus_per_node, resource, head_cpus, object_store_bytes, connect, system_config
    )
    try:
        yield cluster
    finally:
        cluster.shutdown()

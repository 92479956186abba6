"""``stallfree.RayWorkers``: remote workers on a Ray cluster's CPU nodes for ``stallfree.DataLoader``.

``DataLoader(dataset, ..., num_workers=4, remote=RayWorkers(8, resources={"cpu_node": 1}))``:
the trainer's own four workers are used first and eight Ray actors add capacity. Each actor runs
the same stages as a local worker (read, per-sample map, batch decode, collate) from the loader's
frozen plan (``ray_actor.py``), takes its tasks from the same dispatcher (``ray_pool.py``), and
sends its batches back in its tasks' replies (``ray_wire.py``). Order, exactly-once, the rank
split and ``state_dict()`` are the local loader's: a state saved with remote workers resumes with
any other mix, or none.

Placement: the actors go where ``resources`` (a custom resource the CPU nodes were started with,
``ray start --resources='{"cpu_node": 8}'``) or ``node_labels`` say; with neither, on any node but
the trainer's (``include_trainer_node=True`` allows it). This object owns its actors: they start
with the loader's first epoch, serve every epoch after it, and stop with ``loader.close()``.
Use one ``RayWorkers`` per loader.

Ray is imported only here and only when the first epoch starts (the ``ray`` extra): ``import
stallfree`` never imports it. The library takes an ``address``; environment settings for Ray
belong to the script or the CLI that starts it.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from stallfree.engines.ray_actor import RemoteWorker
from stallfree.engines.ray_pool import PoolSettings, RemotePool, RemoteStats, RemoteWorkersLost
from stallfree.extras import require
from stallfree.loader.errors import LoaderError

if TYPE_CHECKING:
    from stallfree.loader.plan import WorkerPlan
    from stallfree.loader.pool import Engine

logger = logging.getLogger(__name__)

__all__ = ["RayWorkers", "RemoteClusterError", "RemoteWorkersLost"]

_ON_LOST = ("local", "raise")
_HEAP_ENV = {  # glibc's malloc: blocks up to 32 MiB from the heap, freed ones kept (RayWorkers(keep_heap=))
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}


class RemoteClusterError(LoaderError):
    """The Ray cluster could not be reached, or could not place the remote workers."""


class RayWorkers:
    """``count`` remote workers on a Ray cluster (see the module docstring).

    ``cpus_per_worker``: CPUs each actor reserves (its decode threads use them: the plan's
    ``decode_threads``). ``resources``: Ray resources each actor needs, e.g. ``{"cpu_node": 1}``.
    ``node_labels``: Ray node labels the actors' nodes must carry. ``address``: the cluster
    (``"HOST:PORT"``, ``"auto"``; None: the Ray this process is connected to, else ``"auto"``).
    ``in_flight``: batches queued on each remote worker at once (its credits; two hides the round
    trip). ``local_ahead``: batches each local worker may hold beyond ``prefetch_factor`` while
    remote workers are used (the loader's in-order window grows by as many), so the local
    workers keep working while a remote batch makes its round trip; a remote worker is sent a
    batch only when it is expected back before the local workers would make it. ``on_lost``: when every remote worker is gone, ``"local"`` goes on with the local
    workers (one warning), ``"raise"`` ends the epoch with ``RemoteWorkersLost``.
    ``reissue_after_s``: a remote batch in flight longer is sent to a second remote worker too
    (None: four times the recent median, at least ``min_reissue_s``). ``start_timeout_s``: how
    long the actors may take to be placed and started. ``connect_timeout_s``: how long a
    ``HOST:PORT`` address may take to answer before it is an error naming it. ``runtime_env``:
    Ray's runtime environment for the actors (the dataset's and ``decode``'s code must import on
    the CPU nodes: an installed package, or ``{"py_modules": [...]}``).
    ``inline_bytes``: a batch up to this size comes back inside its task's reply, straight into
    the trainer's process, instead of through the CPU node's object store and the trainer node's
    raylet (measured on loopback, ``benchmarks/bench_ray_transfer.py``: per 4.8 MB batch ~5.6
    CPU-ms on the CPU node and ~4 in the trainer, none in either raylet, against ~7 and ~9
    through the stores); 0 keeps every batch in the object store. It is Ray's own
    ``max_direct_call_object_size`` (and ``task_rpc_inlined_bytes_limit``), set for the actors'
    processes only, through their ``runtime_env``'s ``env_vars`` (values given there win).
    ``keep_heap``: the actors' ``malloc`` (glibc) serves batch-sized blocks from its heap and
    keeps freed ones for the next batch (``MALLOC_MMAP_THRESHOLD_`` 32 MiB,
    ``MALLOC_TRIM_THRESHOLD_`` 1 GiB in their ``env_vars``): every task allocates a batch and
    Ray a reply of its size, and by default each is fresh pages from the kernel, faulted in and
    zeroed (~1 CPU-ms per 4.8 MB batch on the CPU node, ``benchmarks/bench_ray_transfer.py``).
    The cost is the actor keeping its peak of a few batches' memory.
    """

    def __init__(
        self,
        count: int,
        cpus_per_worker: float = 1,
        resources: dict[str, float] | None = None,
        address: str | None = None,
        *,
        node_labels: dict[str, str] | None = None,
        include_trainer_node: bool = False,
        in_flight: int = 2,
        local_ahead: int = 4,
        on_lost: str = "local",
        reissue_after_s: float | None = None,
        min_reissue_s: float = 5.0,
        start_timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        runtime_env: dict[str, Any] | None = None,
        inline_bytes: int = 64 << 20,
        keep_heap: bool = True,
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"RayWorkers: count must be an int >= 1, got {count!r}")
        if not cpus_per_worker > 0:
            raise ValueError(f"RayWorkers: cpus_per_worker must be > 0, got {cpus_per_worker!r}")
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"RayWorkers: in_flight must be an int >= 1, got {in_flight!r}")
        if isinstance(local_ahead, bool) or not isinstance(local_ahead, int) or local_ahead < 0:
            raise ValueError(f"RayWorkers: local_ahead must be an int >= 0, got {local_ahead!r}")
        if isinstance(inline_bytes, bool) or not isinstance(inline_bytes, int) or inline_bytes < 0:
            raise ValueError(f"RayWorkers: inline_bytes must be an int >= 0, got {inline_bytes!r}")
        if on_lost not in _ON_LOST:
            raise ValueError(f"RayWorkers: on_lost must be one of {_ON_LOST}, got {on_lost!r}")
        if reissue_after_s is not None and not reissue_after_s > 0:
            raise ValueError(f"RayWorkers: reissue_after_s must be > 0 or None, got {reissue_after_s!r}")
        self.count = count
        self.cpus_per_worker = cpus_per_worker
        self.resources = dict(resources or {})
        self.address = address
        self.node_labels = dict(node_labels or {})
        self.include_trainer_node = include_trainer_node
        self.in_flight = in_flight
        self.local_ahead = local_ahead
        self.on_lost = on_lost
        self.reissue_after_s = reissue_after_s
        self.min_reissue_s = min_reissue_s
        self.start_timeout_s = start_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.runtime_env = runtime_env
        self.inline_bytes = inline_bytes
        self.keep_heap = bool(keep_heap)
        self.stats_keeper = RemoteStats()
        self._actors: list[Any] = []
        self._nodes: list[str] = []
        self._first_wid: int | None = None

    def __repr__(self) -> str:
        return (
            f"RayWorkers({self.count}, cpus_per_worker={self.cpus_per_worker}, resources={self.resources}, "
            f"address={self.address!r})"
        )

    @property
    def remote_depth(self) -> int:
        """Batches the remote workers may hold at once."""
        return self.count * self.in_flight

    def depth_for(self, local_workers: int) -> int:
        """Batches added to the loader's in-flight bound beside ``local_workers`` local worker
        processes: the remote workers' credits, and each local worker's ``local_ahead``."""
        return self.remote_depth + max(0, local_workers) * self.local_ahead

    # -- what the loader calls -----------------------------------------------------------------------
    def pool(self, local: Engine, plan: WorkerPlan, prefetch_factor: int, pin_memory: bool) -> RemotePool:
        """The worker pool for one epoch (or a persistent pool): ``local`` plus these workers,
        started on ``plan`` (actors are placed on the first call and kept)."""
        ray = self._connect()
        if self._actors and self._first_wid != local.n:
            self.close()  # worker ids follow the local ones: another local count, new actors
        if not self._actors:
            self._place(ray, local.n)
        plan_ref = ray.put(plan)
        try:
            ray.get([a.start.remote(plan_ref) for a in self._actors], timeout=self.start_timeout_s)
        except Exception as exc:
            raise RemoteClusterError(f"starting the remote workers on their plan failed: {exc}") from exc
        settings = PoolSettings(
            self.in_flight, self.on_lost, self.reissue_after_s, self.min_reissue_s, self.local_ahead
        )
        return RemotePool(
            local,
            settings,
            self.stats_keeper,
            list(self._actors),
            list(self._nodes),
            prefetch_factor,
            pin_memory,
        )

    def stats(self) -> dict[str, Any]:
        """Per remote worker: node, batches, samples, CPU-s, bytes sent, time in flight; and the
        pool's: batches made locally vs remotely, re-issued, duplicates dropped, workers lost,
        the trainer's CPU per remote batch."""
        return self.stats_keeper.as_dict()

    def close(self) -> None:
        """Stop the actors (bounded, never raises)."""
        actors, self._actors, self._nodes = self._actors, [], []
        if not actors:
            return
        import ray

        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - gone already, or Ray shut down
                logger.debug("killing a remote worker failed", exc_info=True)

    # -- connection and placement --------------------------------------------------------------------
    def _connect(self) -> Any:
        ray = require("ray", "ray", "remote workers (stallfree.RayWorkers)")
        if ray.is_initialized():
            return ray
        address = self.address or "auto"
        _check_reachable(address, self.connect_timeout_s)
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except Exception as exc:  # noqa: BLE001 - named with the address, the cause chained
            raise RemoteClusterError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from exc
        return ray

    def _options(self, ray: Any, wid: int, trainer_node: str, nodes: list[dict]) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "num_cpus": self.cpus_per_worker,
            "resources": self.resources,
            "max_restarts": 0,
            "max_concurrency": 1,
            "name": None,
        }
        runtime_env = self._runtime_env()
        if runtime_env is not None:
            opts["runtime_env"] = runtime_env
        if self.node_labels:
            opts["label_selector"] = dict(self.node_labels)
        if not self.resources and not self.node_labels and not self.include_trainer_node:
            # nothing names the CPU nodes: any node but the trainer's, round robin
            others = [n["NodeID"] for n in nodes if n["Alive"] and n["NodeID"] != trainer_node]
            others = [n for n in others if _cpus(nodes, n) >= self.cpus_per_worker]
            if not others:
                raise RemoteClusterError(
                    f"no Ray node other than the trainer's has {self.cpus_per_worker} CPU(s) for a remote "
                    "worker; name the CPU nodes with resources= or node_labels=, or pass include_trainer_node=True"
                )
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                others[wid % len(others)], soft=False
            )
        return opts

    def _runtime_env(self) -> dict[str, Any] | None:
        """The actors' runtime environment: the user's, plus Ray's inline-return settings and
        glibc's heap settings for their processes (read when a worker process starts; a cluster's
        ``_system_config`` would apply to every job, this applies to these actors only)."""
        ours: dict[str, str] = {}
        if self.inline_bytes:
            ours["RAY_max_direct_call_object_size"] = str(self.inline_bytes)
            ours["RAY_task_rpc_inlined_bytes_limit"] = str(self.inline_bytes * max(1, self.in_flight))
        if self.keep_heap:
            ours.update(_HEAP_ENV)
        if not ours:
            return self.runtime_env
        env = dict(self.runtime_env or {})
        env["env_vars"] = {**ours, **dict(env.get("env_vars") or {})}
        return env

    def _place(self, ray: Any, first_wid: int) -> None:
        actor_cls = ray.remote(RemoteWorker)
        trainer_node = ray.get_runtime_context().get_node_id()
        nodes = ray.nodes()
        total = first_wid + self.count
        actors = [
            actor_cls.options(**self._options(ray, r, trainer_node, nodes)).remote(first_wid + r, total)
            for r in range(self.count)
        ]
        refs = [a.node.remote() for a in actors]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        if pending:
            for a in actors:
                ray.kill(a)
            raise RemoteClusterError(
                f"{len(pending)} of {self.count} remote workers could not be placed within "
                f"{self.start_timeout_s:.0f} s: no node offers num_cpus={self.cpus_per_worker}, "
                f"resources={self.resources}, node_labels={self.node_labels} free "
                f"(cluster resources: {ray.available_resources()})"
            )
        infos = ray.get(refs)
        self._actors = actors
        self._nodes = [i.address for i in infos]
        self._first_wid = first_wid
        logger.info("%d remote workers on Ray nodes %s", self.count, sorted(set(self._nodes)))


def _cpus(nodes: list[dict], node_id: str) -> float:
    for n in nodes:
        if n["NodeID"] == node_id:
            return float(n["Resources"].get("CPU", 0.0))
    return 0.0


def _check_reachable(address: str, timeout_s: float) -> None:
    """A ``HOST:PORT`` address must answer a TCP connect (Ray itself would retry for minutes):
    a clear error naming it otherwise. ``auto``, ``ray://`` and ``local`` are Ray's to resolve."""
    if address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RemoteClusterError(f"Ray address {address!r} is not HOST:PORT")
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, timeout_s)):
                return
        except OSError as exc:
            last = exc
            time.sleep(0.2)
    raise RemoteClusterError(f"cannot reach the Ray cluster at {address!r} (GCS port): {last}")

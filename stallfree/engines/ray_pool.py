"""Local and remote workers behind one dispatcher: the worker pool an epoch's ``Assembler`` talks
to when the loader has ``remote=RayWorkers(...)``.

It wraps the local pool (``stallfree/loader/pool.py`` ``Engine``: worker ids ``0..L-1``) and
adds the remote workers as ids ``L..L+R-1``, with the same calls the assembler makes on a local
pool (``send``, ``result``, ``doing``, ``dead``, ...). What it adds:

- **Which worker** (``pick``): a trainer's own worker below ``prefetch_factor`` first; past
  that, the worker expected to deliver the batch first (earliest finish, ``_Rates``: each
  worker's measured pace and a remote worker's round trip), over every worker, full or not: a
  remote worker within its credits (``RayWorkers(in_flight=)``), a local one up to
  ``local_ahead`` batches more (so the in-order window covers a remote round trip), or, when
  the earliest is a full remote worker, none (wait for it). So a remote worker is sent only
  what it should return before a local worker would make it: a slow-but-steady one (its core
  busy with other work) delivers only the batches it was given before its pace was known, then
  now and then gets a probe (a copy of a batch a local worker makes too, delivered only if it
  comes first: measured again without the window ever waiting on it), and never sets the
  epoch's pace. With ``num_workers=0`` the main process's worker thread only when every
  remote worker is gone (it would take the training loop's own core).
- **One stream of results**: a thread forwards the local workers' messages and a collector
  thread waits on the remote workers' object refs; both feed one queue that ``result`` reads.
  A remote batch is copied once out of Ray's memory (the task's reply, or the object store for a
  batch over ``inline_bytes``: ``ray_wire.from_wire``) and its object freed, so the trainer holds
  no more than the batches in flight.
- **Exactly once**: every dispatched batch is a flight keyed by ``(gen, seq)``; the first
  result delivers it and ends the flight, any later one (a re-issued copy) is dropped, counted.
- **Deadlines**: a remote batch in flight longer than its deadline (``reissue_after_s``, or
  four times the recent median, at least ``min_reissue_s``) is sent once more: to another live
  remote worker with room, else to a local worker process (never the main process's thread);
  whichever finishes first is kept. So a hung remote worker cannot hang the epoch.
- **Faults**: a remote worker whose call fails with Ray's actor or node errors is gone; its
  batches go to another live remote worker, or, when none is left, to the local workers (one
  warning) or end the epoch with ``RemoteWorkersLost`` (``on_lost="raise"``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from stallfree.engines.ray_actor import RemoteResult
from stallfree.engines.ray_wire import from_wire
from stallfree.loader.errors import LoaderError
from stallfree.loader.messages import BatchReady, Task, WorkerFailure

if TYPE_CHECKING:
    from stallfree.loader.pool import Engine

logger = logging.getLogger(__name__)

_WAIT_S = 0.02  # the collector's longest wait on the refs before it looks at deadlines and new refs
_COLD_DEADLINE_S = 60.0  # before enough batches came back to know a typical time
_PROBE_AFTER = 8  # batches dispatched elsewhere before a passed-over idle remote worker gets a probe
_RATE_SAMPLES = 6  # recent batches per worker the expected times are taken from


class RemoteWorkersLost(LoaderError):
    """Every remote worker is gone and the loader was told not to go on without them."""


@dataclass(frozen=True)
class PoolSettings:
    """The pool's rules, from ``RayWorkers`` (see its docstring)."""

    in_flight: int
    on_lost: str
    reissue_after_s: float | None
    min_reissue_s: float
    local_ahead: int = 0  # batches each local worker may hold beyond prefetch_factor


@dataclass
class _Flight:
    """One dispatched batch until its first result is delivered."""

    task: Task
    charged: int  # the worker id the assembler counted it against
    attempts: dict[Any, int] = field(default_factory=dict)  # live remote ref -> remote worker id
    sent_at: float = 0.0
    reissued: bool = False
    local: bool = False  # running on a local worker (dispatched there, or fallen back)
    ahead: int = 0  # batches its worker held when it was sent (for the worker's pace)


@dataclass
class _Raise:
    error: BaseException


class _Rates:
    """What the dispatcher knows of each worker's pace, to send a remote worker only the batches
    it can return before the local workers would reach them.

    A worker's *pace* is the time between its deliveries while busy (a batch starts when the one
    ahead of it was delivered, or when it was sent if the worker was idle): for a remote worker
    that includes whatever limits it (its core, the object transfer). A remote worker's *round
    trip* for a batch with ``k`` ahead of it is ``base + k * pace``, ``base`` taken from the
    recent batches' dispatch-to-delivery times less the queue they waited behind. Paces are
    medians of the last few batches; ``base`` is their upper quantile, not their median: a
    remote batch sent on too rosy a guess holds up the in-order window, while one kept local on
    too dark a guess costs only the remote core's spare time."""

    def __init__(self, workers: int) -> None:
        self.pace: list[deque[float]] = [deque(maxlen=_RATE_SAMPLES) for _ in range(workers)]
        self.trips: list[deque[tuple[float, int]]] = [deque(maxlen=_RATE_SAMPLES) for _ in range(workers)]
        self.done_at = [0.0] * workers

    def delivered(self, wid: int, sent_at: float, ahead: int, now: float) -> None:
        self.pace[wid].append(now - max(sent_at, self.done_at[wid]))
        self.trips[wid].append((now - sent_at, ahead))
        self.done_at[wid] = now

    def local_eta(self, local_ids: range, inflight: list[int]) -> float | None:
        """When a batch sent now to the least busy local worker would be made (None: not known)."""
        paces = [p for w in local_ids for p in self.pace[w]]
        if not paces:
            return None
        return (min(inflight[w] for w in local_ids) + 1) * statistics.median(paces)

    def remote_eta(self, wid: int, ahead: int) -> float | None:
        """When remote worker ``wid`` would deliver a batch sent now behind ``ahead`` others."""
        if not self.pace[wid]:
            return None
        pace = statistics.median(self.pace[wid])
        bases = sorted(trip - k * pace for trip, k in self.trips[wid])
        base = bases[(len(bases) * 4) // 5] if len(bases) > 1 else bases[0]  # ~80th percentile
        return max(base, pace) + ahead * pace


class RemoteStats:
    """Counters per remote worker and for the pool, kept by ``RayWorkers`` across epochs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: dict[int, dict[str, Any]] = {}
        self.local_batches = 0
        self.remote_batches = 0
        self.reissued = 0
        self.passed_over = 0  # batches kept for local workers: the remote ones would be later
        self.probes = 0  # copies of local batches sent to a passed-over remote worker to measure it
        self.duplicates_dropped = 0
        self.retried = 0  # batches run again after their worker died
        self.fell_back = 0  # batches sent to local workers because no remote worker was left
        self.workers_lost = 0
        self.trainer_cpu_s = 0.0  # the trainer's CPU for remote batches: ray.get + copy out
        self.received_bytes = 0

    def worker(self, wid: int, node: str) -> dict[str, Any]:
        return self.workers.setdefault(
            wid,
            {
                "node": node,
                "alive": True,
                "batches": 0,
                "samples": 0,
                "failures": 0,
                "cpu_s": 0.0,
                "busy_s": 0.0,
                "bytes_sent": 0,
                "in_flight_s": 0.0,
            },
        )

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            remote = self.remote_batches
            return {
                "workers": {w: dict(v) for w, v in sorted(self.workers.items())},
                "batches_local": self.local_batches,
                "batches_remote": remote,
                "reissued": self.reissued,
                "passed_over": self.passed_over,
                "probes": self.probes,
                "duplicates_dropped": self.duplicates_dropped,
                "retried": self.retried,
                "fell_back_to_local": self.fell_back,
                "workers_lost": self.workers_lost,
                "trainer_cpu_s": self.trainer_cpu_s,
                "trainer_cpu_ms_per_batch": 1000 * self.trainer_cpu_s / remote if remote else 0.0,
                "bytes_received": self.received_bytes,
                "bytes_per_batch": self.received_bytes / remote if remote else 0.0,
            }


class RemotePool:
    """The local pool plus remote workers (see the module docstring)."""

    def __init__(
        self,
        local: Engine,
        settings: PoolSettings,
        stats: RemoteStats,
        actors: list[Any],
        nodes: list[str],
        prefetch_factor: int,
        pin: bool,
    ) -> None:
        import ray

        self._ray = ray
        self.local = local
        self.remote = settings
        self.actors = actors
        self.nodes = nodes
        self.L = local.n
        self.n = self.L + len(actors)
        self.gen = 0
        self.remote_depth = len(actors) * settings.in_flight
        self.storages = local.storages
        self.returns = local.returns
        self._pf = max(1, prefetch_factor)
        self._local_cap = self._pf + max(0, settings.local_ahead)
        self._rates = _Rates(self.n)
        self._passed = [0] * self.n  # per remote worker: batches sent elsewhere since its last one
        self._probe: int | None = None  # the remote worker the next local batch is copied to
        self._pin = pin
        self._stats = stats
        self._lock = threading.Lock()
        self._inflight = [0] * self.n
        self._alive = [True] * self.n  # local ones are the local pool's business: always True here
        self._flights: dict[tuple[int, int], _Flight] = {}
        self._refs: dict[Any, tuple[tuple[int, int], int, float]] = {}  # ref -> (key, remote wid, sent)
        self._charged: dict[tuple[int, int], int] = {}
        self._local_copies: set[tuple[int, int]] = set()  # late remote batches also sent to a local worker
        self._times: deque[float] = deque(maxlen=32)  # recent remote in-flight times
        self._rotate = itertools.count()
        self._ticks = itertools.count()
        self._warned_lost = False
        self.out: queue.Queue = queue.Queue()
        self.closed = False
        self._stop = threading.Event()
        for r, node in enumerate(nodes):
            self._stats.worker(self.L + r, node)
        self._collector = threading.Thread(target=self._collect, daemon=True, name="stallfree-remote-collect")
        self._forwarder = threading.Thread(target=self._forward, daemon=True, name="stallfree-local-forward")
        self._collector.start()
        self._forwarder.start()

    # -- what the assembler calls (the local pool's interface) ---------------------------------------
    @property
    def in_process(self) -> bool:
        return self.local.in_process

    @property
    def procs(self) -> list[Any]:
        return self.local.procs

    @property
    def inline_results(self) -> Any:
        return self.local.inline_results

    def start_rest(self) -> None:
        self.local.start_rest()

    def storage_of(self, worker: int, new_storage: Any) -> Any:
        return self.local.storage_of(worker, new_storage) if worker < self.L else new_storage

    def discard_segment(self, worker: int, new_storage: Any) -> None:
        if worker < self.L:
            self.local.discard_segment(worker, new_storage)

    def pick(self) -> int | None:
        """The worker for the next batch (None: wait). A local worker below ``prefetch_factor``
        first (not the main process's thread while a remote worker lives); past that, the
        worker expected to deliver it first (earliest finish), a local one on a tie: a remote
        worker within its credits, or a local one up to ``local_ahead`` more; when that worker
        is full, wait for it rather than give the batch to a later one. While the paces are not
        known yet: a remote worker with room, else a local one."""
        with self._lock:
            remote_alive = [w for w in range(self.L, self.n) if self._alive[w]]
            free = sorted(
                (w for w in remote_alive if self._inflight[w] < self.remote.in_flight),
                key=lambda w: self._inflight[w],
            )
            if self.local.in_process and remote_alive:
                return free[0] if free else None
            start = next(self._rotate)
            order = [(start + i) % self.L for i in range(self.L)]
            for w in order:
                if self._inflight[w] < self._pf:
                    return w
            room = [w for w in order if self._inflight[w] < self._local_cap]
            local = min(room, key=lambda w: self._inflight[w]) if room else None
            local_eta = self._rates.local_eta(range(self.L), self._inflight)
            etas: dict[int, float] = {}
            for w in remote_alive:
                eta = self._rates.remote_eta(w, self._inflight[w])
                if eta is None or local_eta is None:
                    return free[0] if free else local  # cold: the remote workers' credits first
                etas[w] = eta
            best = min(etas, key=etas.__getitem__, default=None)
            if best is not None and local_eta is not None and etas[best] < local_eta:
                return best if best in free else None  # it is worth waiting for
            if local is not None and free:
                with self._stats.lock:
                    self._stats.passed_over += 1
                idle = [w for w in free if self._inflight[w] == 0 and self._passed[w] >= _PROBE_AFTER]
                if idle:
                    self._probe = idle[0]  # a copy of the local batch: measured, never waited for
            return local

    def send(self, worker: int, task: Task) -> None:
        key = (task.gen, task.seq)
        with self._lock:
            if self._charged and next(iter(self._charged))[0] < task.gen:
                # a persistent pool's new iterator: the last one's leftovers are never asked for
                self._charged = {k: w for k, w in self._charged.items() if k[0] >= task.gen}
            self._charged[key] = worker
            flight = _Flight(task, worker, sent_at=time.monotonic(), local=worker < self.L)
            flight.ahead = self._inflight[worker]
            self._flights[key] = flight
            probe, self._probe = self._probe, None
            for w in range(self.L, self.n):
                self._passed[w] = 0 if w in (worker, probe) else self._passed[w] + 1
            if worker < self.L:
                self._inflight[worker] += 1
                with self._stats.lock:
                    self._stats.local_batches += 1
                if probe is not None:
                    self._local_copies.add(key)  # a remote result first makes the local one a leftover
        if worker < self.L:
            self.local.send(worker, task)
            if probe is not None:
                with self._stats.lock:
                    self._stats.probes += 1
                self._submit(flight, probe)
        else:
            self._submit(flight, worker)

    def charged_to(self, msg: BatchReady | WorkerFailure) -> int:
        """The worker the assembler counted this batch against (a batch that fell back from a
        remote worker to a local one comes back from the local one)."""
        with self._lock:
            return self._charged.pop((msg.gen, msg.seq), msg.worker)

    def result(self, timeout: float) -> Any:
        if self.local.inline_results:  # the pool's first batch, made here as worker 0 would
            msg = self.local.inline_results.popleft()
            with self._lock:
                if self._flights.pop((msg.gen, msg.seq), None) is not None:
                    self._inflight[msg.worker] -= 1  # the forwarder never sees it
            return msg
        item = self.out.get(timeout=timeout)
        if isinstance(item, _Raise):
            raise item.error
        return item

    def doing(self, wid: int) -> str:
        if wid < self.L:
            return self.local.doing(wid)
        state = "alive" if self._alive[wid] else "gone"
        return f"(remote, Ray node {self.nodes[wid - self.L]}, {state}): {self._inflight[wid]} batch(es) in flight"

    def progress_mark(self, wid: int) -> tuple[int, ...]:
        # a remote worker is never "hung" to the assembler: its deadlines re-issue its batches here
        return self.local.progress_mark(wid) if wid < self.L else (next(self._ticks),)

    def pid(self, wid: int) -> int | None:
        return self.local.pid(wid) if wid < self.L else None

    def dead(self, wid: int) -> tuple[bool, int | None]:
        return self.local.dead(wid) if wid < self.L else (False, None)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the threads, cancel what the remote workers were still given, stop the local
        pool. The actors stay (``RayWorkers`` owns them: the next epoch reuses them)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        with self._lock:
            refs = list(self._refs)
            self._refs.clear()
            self._flights.clear()
        for ref in refs:
            with contextlib.suppress(Exception):
                self._ray.cancel(ref)
        for t in (self._forwarder, self._collector):
            if t is not threading.current_thread():
                t.join(timeout=1.0)
        self.local.shutdown(graceful)

    # -- remote dispatch -----------------------------------------------------------------------------
    def _submit(self, flight: _Flight, rwid: int) -> None:
        ref = self.actors[rwid - self.L].run.remote(flight.task)
        now = time.monotonic()
        with self._lock:
            flight.attempts[ref] = rwid
            self._refs[ref] = ((flight.task.gen, flight.task.seq), rwid, now, self._inflight[rwid])
            self._inflight[rwid] += 1

    def _other_remote(self, exclude: set[int], allow_full: bool) -> int | None:
        with self._lock:
            live = [w for w in range(self.L, self.n) if self._alive[w] and w not in exclude]
            if not allow_full:
                live = [w for w in live if self._inflight[w] < self.remote.in_flight]
            return min(live, key=lambda w: self._inflight[w]) if live else None

    def _deadline(self) -> float:
        if self.remote.reissue_after_s is not None:
            return self.remote.reissue_after_s
        if len(self._times) < 4:
            return _COLD_DEADLINE_S
        return max(self.remote.min_reissue_s, 4 * statistics.median(self._times))

    def _reissue_late(self) -> None:
        now, limit = time.monotonic(), self._deadline()
        with self._lock:
            late = [
                f
                for f in self._flights.values()
                if not f.local and not f.reissued and f.attempts and now - f.sent_at > limit
            ]
        for f in late:
            w = self._other_remote(set(f.attempts.values()), allow_full=False)
            if w is None and self.local.in_process:
                continue  # the training loop's own thread is no place for a copy: wait for room
            f.reissued = True
            if w is None:  # no other remote worker has room: a local worker makes a copy
                w = self._local_copy(f)
            logger.info(
                "batch %d has been on remote worker(s) %s for %.1f s (deadline %.1f s): sent to worker %d too",
                f.task.seq,
                sorted(set(f.attempts.values())),
                now - f.sent_at,
                limit,
                w,
            )
            with self._stats.lock:
                self._stats.reissued += 1
            if w >= self.L:
                self._submit(f, w)

    def _local_copy(self, flight: _Flight) -> int:
        """Send a late remote batch to the least busy local worker as well; whichever result
        comes first is delivered (the forwarder turns a later local copy into a leftover)."""
        with self._lock:
            w = min(range(self.L), key=lambda x: self._inflight[x])
            self._inflight[w] += 1
            self._local_copies.add((flight.task.gen, flight.task.seq))
        self.local.send(w, flight.task)
        return w

    def _lost(self, rwid: int, exc: BaseException) -> None:
        with self._lock:
            if not self._alive[rwid]:
                return
            self._alive[rwid] = False
            left = sum(self._alive[self.L :])
        with self._stats.lock:
            self._stats.workers_lost += 1
            self._stats.workers[rwid]["alive"] = False
        logger.warning(
            "remote worker %d on Ray node %s is gone (%s: %s); its batches run elsewhere (%d remote worker(s) left)",
            rwid,
            self.nodes[rwid - self.L],
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
            left,
        )

    def _rerun(self, flight: _Flight) -> None:
        """A batch whose every attempt failed with its worker: another remote worker, else the
        local workers (or the end of the epoch, by ``on_lost``)."""
        with self._stats.lock:
            self._stats.retried += 1
        w = self._other_remote(set(), allow_full=True)
        if w is not None:
            self._submit(flight, w)
            return
        if self.remote.on_lost == "raise":
            self.out.put(
                _Raise(
                    RemoteWorkersLost(
                        f"every remote worker is gone ({len(self.actors)} on {sorted(set(self.nodes))}); "
                        f"batch {flight.task.seq} was not made (RayWorkers(on_lost='raise'))"
                    )
                )
            )
            return
        if not self._warned_lost:
            self._warned_lost = True
            logger.warning(
                "every remote worker is gone (%d on %s): the loader goes on with its local workers",
                len(self.actors),
                sorted(set(self.nodes)),
            )
        with self._lock:
            local = min(range(self.L), key=lambda w: self._inflight[w])
            self._inflight[local] += 1
            flight.local = True
        with self._stats.lock:
            self._stats.fell_back += 1
        self.local.send(local, flight.task)

    # -- the threads ---------------------------------------------------------------------------------
    def _forward(self) -> None:
        """The local workers' messages into the one result queue."""
        q = self.local.result_q
        while not self._stop.is_set():
            try:
                msg = q.get(timeout=0.1)
            except queue.Empty:
                continue
            except (ConnectionError, EOFError, OSError) as exc:  # a local worker died mid-send
                if not self._stop.is_set():
                    self.out.put(_Raise(exc))
                return
            if isinstance(msg, (BatchReady, WorkerFailure)):
                key = (msg.gen, msg.seq)
                with self._lock:
                    if msg.worker < self.L:
                        self._inflight[msg.worker] -= 1
                    late_copy = key in self._local_copies and key not in self._flights
                    copy = key in self._local_copies
                    self._local_copies.discard(key)
                    flight = self._flights.pop(key, None)
                    if (
                        flight is not None
                        and not copy
                        and msg.worker < self.L
                        and flight.charged == msg.worker
                    ):
                        self._rates.delivered(msg.worker, flight.sent_at, flight.ahead, time.monotonic())
                if late_copy:  # its remote original was delivered: a leftover to the assembler,
                    # which hands its slot back to the worker and delivers nothing
                    msg = replace(msg, gen=-1)
                    with self._stats.lock:
                        self._stats.duplicates_dropped += 1
            self.out.put(msg)

    def _collect(self) -> None:
        ray = self._ray
        while not self._stop.is_set():
            with self._lock:
                refs = list(self._refs)
            if not refs:
                time.sleep(_WAIT_S)
                continue
            try:
                ready, rest = ray.wait(refs, num_returns=1, timeout=_WAIT_S)
                if ready and rest:
                    more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                    ready += more
            except Exception as exc:  # noqa: BLE001 - Ray itself failed: the epoch cannot go on
                if not self._stop.is_set():
                    self.out.put(_Raise(LoaderError(f"waiting on remote workers failed: {exc}")))
                return
            for ref in ready:
                if self._stop.is_set():
                    return
                self._settle(ref)
            self._reissue_late()

    def _settle(self, ref: Any) -> None:
        ray = self._ray
        with self._lock:
            entry = self._refs.pop(ref, None)
            if entry is None:
                return
            key, rwid, sent, ahead = entry
            self._inflight[rwid] -= 1
            flight = self._flights.get(key)
            if flight is not None:
                flight.attempts.pop(ref, None)
        c0 = time.thread_time()
        try:
            res: RemoteResult = ray.get(ref)
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.ObjectLostError,
            ray.exceptions.NodeDiedError,
        ) as exc:
            self._lost(rwid, exc)
            if flight is not None and not flight.attempts and not flight.local:
                self._rerun(flight)
            return
        except ray.exceptions.RayTaskError as exc:  # run() itself raised (not a stage: those are messages)
            res = None
            error: Any = exc
        if res is not None:  # its pace, whether or not its copy is the one delivered
            with self._lock:
                self._rates.delivered(rwid, sent, ahead, time.monotonic())
        if res is None and flight is not None and flight.local:
            return  # a probe that failed: the local worker makes the batch (and says why if it fails)
        if flight is None or key not in self._flights:  # delivered already (a re-issued copy)
            with self._stats.lock:
                self._stats.duplicates_dropped += 1
            return
        if res is not None:
            msg = res.message
            if isinstance(msg, BatchReady):
                msg = replace(msg, worker=flight.charged, payload=from_wire(msg.payload, self._pin))
            else:
                err = msg.error
                if isinstance(err, BaseException):  # ours (BatchDecodeError): add where it was made
                    err.add_note(f"stallfree: made by remote worker {rwid} on Ray node {res.node}")
                msg = replace(msg, worker=flight.charged)
        else:
            first = flight.task.indices[0] if flight.task.indices else None
            msg = WorkerFailure(key[0], key[1], flight.charged, first, None, error)
        cpu = time.thread_time() - c0
        now = time.monotonic()
        with self._lock:
            if self._flights.pop(key, None) is None:
                return
            self._times.append(now - sent)
        with self._stats.lock:
            s = self._stats
            s.remote_batches += 1
            if (
                flight.local
            ):  # a probe's copy came first: the batch is the remote worker's, not the local one's
                s.local_batches -= 1
            s.trainer_cpu_s += cpu
            w = s.workers[rwid]
            w["in_flight_s"] += now - sent
            if res is not None:
                s.received_bytes += res.sent_bytes
                w["cpu_s"] += res.cpu_s
                w["busy_s"] += res.wall_s
                w["bytes_sent"] += res.sent_bytes
            if isinstance(msg, BatchReady):
                w["batches"] += 1
                w["samples"] += msg.good
                w["failures"] += len(msg.failures)
            else:
                w["failures"] += 1
        self.out.put(msg)

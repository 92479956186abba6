"""Multi-rank training harness: launches N ranks (or joins an existing torchrun job), runs a DDP-like
loop per rank (next batch -> step -> all-reduce), and returns the stall figures of each phase.

A *phase* is one measured run: a loader on a dataset variant (cold, a cached subset, a partly
cached copy) with a step. All phases of a bench run inside the same ranks, one after the other,
so loaders are compared on the same data, step and processes. Ranks talk over ``gloo`` on CPU and
``nccl`` on GPU; rank 0 gathers every rank's figures.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.harness import analyze, report, tune
from stallfree.harness.config import BenchConfig
from stallfree.harness.errors import RankFailed, error_line
from stallfree.harness.phases import Phase, Purpose, Variant
from stallfree.harness.plan import BenchData, BenchPlan, PhaseRun, loader_phases, open_data, plan_bench

# BenchConfig, Phase and RankFailed are part of the programmatic entry (see harness/__init__.py).
__all__ = ["BenchConfig", "Phase", "RankFailed", "loader_phases", "rank_main", "run_bench", "run_phases"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- inside one rank


def loopback_store(timeout_s: float = 600.0) -> tuple[Any, int]:
    """The ranks' rendezvous store, served by the launching process on 127.0.0.1 only; and its port.

    A TCPStore that binds its own socket listens on every interface; handed a socket already
    bound to loopback, it serves there (and owns, and closes, that socket). The port comes from
    that bind, so nothing can take it between choosing and listening."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return store, port


class _Subset:
    """The first ``n`` samples of ``base`` (a cached-subset run reads only these)."""

    def __init__(self, base: Any, n: int) -> None:
        self.base, self.n = base, min(n, len(base))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.n:
            raise IndexError(f"sample index {index} out of range for {self.n} samples")
        return self.base[index]

    def get_many(self, indices: list[int]) -> list[Any]:
        return [self[i] for i in indices]


@dataclass(frozen=True)
class RankPlace:
    """Where this process sits in the job: its rank, the world, and its place on its node."""

    rank: int
    world: int
    local_rank: int
    local_size: int


def _phase_dataset(run: PhaseRun, data: BenchData) -> Any:
    from stallfree.harness.datasets import PartialCache, SlowDataset

    phase = run.phase
    if phase.loader == "synthetic":
        return data.dataset
    ds = SlowDataset(data.dataset, run.slow_delay_s) if run.slow_delay_s > 0 else data.dataset
    warm = data.warm
    if phase.variant is Variant.CACHED:
        subset = phase.subset or len(ds)
        return PartialCache(_Subset(ds, subset), 1.0, None if warm is None else _Subset(warm, subset))
    if phase.variant is Variant.COLD and run.cache_fraction <= 0:
        return ds
    return PartialCache(ds, run.cache_fraction, warm)


def _run_phase(run: PhaseRun, data: BenchData, place: RankPlace, dist: Any) -> dict[str, Any]:
    from stallfree.harness.loaders import LoaderSettings, make_adapter
    from stallfree.harness.metrics import RankMetrics
    from stallfree.harness.steps import batch_size_of, make_step

    step_kind, rank = run.step, place.rank
    step = make_step(
        "sleep" if step_kind == "none" else step_kind,
        0.0 if step_kind == "none" else run.step_ms,
        device=run.device,
        seed=run.seed,
    )
    settings = LoaderSettings(
        dataset=_phase_dataset(run, data),
        rank=rank,
        world_size=place.world,
        local_rank=place.local_rank,
        local_size=place.local_size,
        batch_size=run.batch_size,
        workers=run.workers,
        prefetch=run.prefetch,
        image_size=run.image_size,
        seed=run.seed,
        decode=run.decode,
        device=run.device,
        worker_start=run.worker_start,
        extra=dict(run.loader_options),
        remote=run.remote,
    )
    if run.decode == "none":  # read only: the MLPerf Storage workloads (au_bench.py)
        from stallfree.harness.workload.loaders import make_read_adapter as make_adapter
    try:
        adapter = make_adapter(run.phase.loader, settings)
    except (ValueError, ImportError) as exc:  # e.g. a tar-only reader on a non-tar dataset
        logger.warning("rank %d: loader %s cannot run on this dataset: %s", rank, run.phase.loader, exc)
        return {"skipped": str(exc)}
    metrics = RankMetrics(rank, warmup=run.warmup)
    grads = step.grads()
    if dist is not None and run.device.startswith("cuda"):
        grads = grads.to(run.device)
    try:
        batches = adapter.batches()
        if dist is not None:
            dist.barrier()
        metrics.start()
        perf = time.perf_counter
        for i in range(run.warmup + run.steps):
            if i == run.warmup:
                metrics.begin_measured()
            t0 = perf()
            batch = next(batches)
            t1 = perf()
            if step_kind != "none":
                step(batch)
            t2 = perf()
            if dist is not None:
                dist.all_reduce(grads)
            t3 = perf()
            metrics.record(t0, t1, t2, t3, batch_size_of(batch))
        metrics.stop()
        stats = adapter.stats()
        decode = adapter.decode_label()
    finally:
        adapter.close()
    return {
        "summary": metrics.summary(),
        "timeline": metrics.timeline() if run.timeline else [],
        "stats": _jsonable(stats),
        "decode": decode,
    }


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return json.loads(json.dumps(value, default=str))


def _progress(show: bool, phases: int, rank: int) -> Any:
    if not show or rank != 0:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=phases, desc="bench phases", unit="phase", file=sys.stderr)


def rank_main(
    plan: BenchPlan,
    rank: int,
    world: int,
    out_path: str | None,
    store_port: int | None = None,
    data: BenchData | None = None,
) -> list[dict] | None:
    """Body of one rank: join the process group, run every phase of ``plan``, gather to rank 0.

    ``data`` is the bench's data when this process opened it already (one rank in the launching
    process); a spawned rank opens it here, once. The group meets at the launcher's
    :func:`loopback_store` on ``store_port`` when given (spawned ranks), else at the config's
    ``init_method`` (inside torchrun). Returns (on rank 0) one entry per phase:
    ``{"phase": ..., "ranks": [per-rank results]}``.
    """
    import torch
    import torch.distributed as dist

    cfg = plan.config
    in_job = cfg.rank is not None  # inside torchrun: the node's layout comes from its env
    place = RankPlace(
        rank, world, cfg.local_rank if in_job else rank, (cfg.local_size or world) if in_job else world
    )
    torch.set_num_threads(1)
    group = None
    if world > 1:
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(place.local_rank)
        timeout = datetime.timedelta(seconds=600)
        if store_port is not None:  # a client of the launcher's store: nothing listens here
            store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=cfg.init_method, rank=rank, world_size=world, timeout=timeout
            )
        group = dist
    bar = _progress(cfg.progress, len(plan.runs), rank)
    try:
        data = data if data is not None else open_data(cfg)
        results = []
        for run in plan.runs:
            logger.info("rank %d: phase %s", rank, run.phase.label)
            if bar is not None:
                bar.set_postfix_str(run.phase.label)
            mine = _run_phase(run, data, place, group)
            if bar is not None:
                bar.update(1)
            if group is not None:
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, mine)
            else:
                gathered = [mine]
            results.append({"phase": run.phase.as_dict(), "ranks": gathered})
    finally:
        if bar is not None:  # also when a phase raised, so an error prints below the bar
            bar.close()
        if group is not None:
            dist.destroy_process_group()
    if rank == 0 and out_path:
        Path(out_path).write_text(json.dumps(results))
    return results if rank == 0 else None


def _spawned(
    rank: int,
    plan: BenchPlan,
    world: int,
    out_path: str,
    log_level: int,
    store_port: int,
) -> None:
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        rank_main(plan, rank, world, out_path, store_port)
    except BaseException as exc:
        # When one rank fails, its peers fail right after in the collective (gloo: "connection
        # closed"); the parent reports the earliest failure, the cause, not whichever it sees first.
        line = f"{type(exc).__name__}: {error_line(exc)}"
        failure = [time.time(), line, _peer_failure(exc)]
        with contextlib.suppress(OSError):
            Path(f"{out_path}.rank{rank}.err").write_text(json.dumps(failure))
        raise


def _peer_failure(exc: BaseException) -> bool:
    """The collective failed because a peer went away: gloo raises a plain RuntimeError naming its
    transport ("...gloo/transport/tcp/pair.cc... typically caused by a remote worker crashing"),
    newer torch a DistError. Such an error is an effect, never the cause to report: timestamps
    alone misjudged it, since the failed rank's unwinding closes its sockets (so its peers fail)
    before its own handler stamps the time (seen once under load: the gloo error was reported
    instead of the corrupt sample)."""
    try:
        from torch.distributed import DistError
    except ImportError:  # an older torch: no such class
        DistError = ()  # noqa: N806
    text = str(exc)
    return isinstance(exc, DistError) or "gloo/transport" in text or "remote worker crashing" in text


def _first_failure(out_path: str, world: int) -> tuple[int, str] | None:
    """(rank, error line) of the rank that failed first, from the files ``_spawned`` leaves; a
    rank whose collective failed because a peer went away comes after every rank that failed
    for a reason of its own."""
    seen = []
    for rank in range(world):
        with contextlib.suppress(OSError, ValueError):
            when, line, peer = json.loads(Path(f"{out_path}.rank{rank}.err").read_text())
            seen.append((bool(peer), when, rank, line))
    if not seen:
        return None
    _, _, rank, line = min(seen)
    return rank, line


def run_phases(plan: BenchPlan, data: BenchData | None = None) -> list[dict] | None:
    """Run ``plan``'s phases on ``config.nproc`` freshly spawned ranks, or in this process (one
    rank, or, when ``config.rank`` is set, inside torchrun as that rank: then on ``data`` when
    this process opened it already). Returns the gathered results on rank 0, else None."""
    cfg = plan.config
    if cfg.rank is not None:
        world = cfg.world_size or 1
        if world > 1 and not cfg.init_method:
            raise ValueError("running inside a job of several ranks needs init_method (tcp://MASTER:PORT)")
        return rank_main(plan, cfg.rank, world, None, data=data)
    if cfg.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < cfg.nproc:
            raise ValueError(
                f"--nproc {cfg.nproc} ranks on CUDA need as many GPUs; {torch.cuda.device_count()} visible"
            )
    if cfg.nproc == 1:
        return rank_main(plan, 0, 1, None, data=data)
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    store, port = loopback_store()  # held open until every rank is done
    with tempfile.TemporaryDirectory(prefix="stallfree-bench-") as tmp:
        out_path = os.path.join(tmp, "results.json")
        try:
            mp.start_processes(
                _spawned,
                args=(plan, cfg.nproc, out_path, logging.getLogger().level, port),
                nprocs=cfg.nproc,
                join=True,
                start_method="spawn",
            )
        except ProcessException as exc:  # its message is the rank's whole traceback
            first = _first_failure(out_path, cfg.nproc)
            if first is None:  # died without raising (killed): what torch saw
                last = next((ln for ln in reversed(str(exc).splitlines()) if ln.strip()), "no message")
                first = (exc.error_index, last.strip())
            raise RankFailed(f"rank {first[0]} failed: {first[1]}") from exc
        finally:
            del store
        return json.loads(Path(out_path).read_text())


def _dataset_len(data: BenchData) -> int | None:
    try:
        return len(data.dataset)
    except Exception as exc:  # informative only: the bench itself already ran on it
        logger.warning("could not read the dataset length for the report: %s", exc)
        return None


def run_bench(cfg: BenchConfig) -> dict[str, Any] | None:
    """The programmatic entry: run the loaders (and analysis / tuning when asked) and return the
    report dict (see report.build_report); None on ranks other than 0 inside torchrun.

    The config is validated and planned once (harness/plan.py), and the data opened once in this
    process; the ranks run the plan's values."""
    cfg.validate()
    data = open_data(cfg)
    plan = plan_bench(cfg, data)
    started = time.time()
    gathered = run_phases(plan, data)
    if gathered is None:
        return None
    skipped = dict(plan.skipped)
    results: dict[Phase, dict[str, Any]] = {}
    for phase, r in zip(plan.phases, gathered, strict=True):
        reason = next((x["skipped"] for x in r["ranks"] if "skipped" in x), None)
        if reason is None:
            results[phase] = r
        elif phase.purpose is Purpose.BENCH:
            skipped[phase.label] = reason
        else:
            raise ValueError(f"phase {phase.label} could not run: {reason}")
    ran = [results[p] for p in plan.bench if p in results]
    rep = report.build_report(cfg, ran, skipped, elapsed_s=time.time() - started)
    rep["dataset_samples"] = _dataset_len(data)
    if cfg.analyze:
        rep["analysis"] = analyze.analyze(cfg, results, plan.analysis, data.probe)
    if cfg.tune:
        rep["tune"] = tune.summarize(cfg, results)
    return rep

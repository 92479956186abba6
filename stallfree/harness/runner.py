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
from pathlib import Path
from typing import Any

from stallfree.harness import analyze, report, tune
from stallfree.harness.config import BenchConfig
from stallfree.harness.errors import RankFailed, error_line
from stallfree.harness.phases import Phase, Purpose, Variant

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


def _phase_dataset(cfg: BenchConfig, phase: Phase, base: Any, warm: Any) -> Any:
    from stallfree.harness.datasets import PartialCache, SlowDataset

    ds = SlowDataset(base, cfg.slow_delay_s) if cfg.slow_delay_s > 0 else base
    fraction = cfg.cache_fraction if phase.cache_fraction is None else phase.cache_fraction
    if phase.variant is Variant.CACHED:
        subset = phase.subset or len(ds)
        return PartialCache(_Subset(ds, subset), 1.0, None if warm is None else _Subset(warm, subset))
    if phase.variant is Variant.COLD and fraction <= 0:
        return ds
    return PartialCache(ds, fraction, warm)


def _run_phase(
    cfg: BenchConfig, phase: Phase, base: Any, warm: Any, rank: int, world: int, dist: Any
) -> dict[str, Any]:
    from stallfree.harness.loaders import LoaderSettings, make_adapter
    from stallfree.harness.metrics import RankMetrics
    from stallfree.harness.steps import batch_size_of, make_step

    step_kind = phase.step or cfg.step
    step = make_step(
        "sleep" if step_kind == "none" else step_kind,
        0.0 if step_kind == "none" else cfg.step_ms,
        device=cfg.device,
        seed=cfg.seed,
    )
    settings = LoaderSettings(
        dataset=_phase_dataset(cfg, phase, base, warm) if phase.loader != "synthetic" else base,
        rank=rank,
        world_size=world,
        local_rank=cfg.local_rank if cfg.rank is not None else rank,
        local_size=(cfg.local_size or world) if cfg.rank is not None else world,
        batch_size=cfg.batch_size,
        workers=cfg.workers if phase.workers is None else phase.workers,
        prefetch=cfg.prefetch if phase.prefetch is None else phase.prefetch,
        image_size=cfg.image_size,
        seed=cfg.seed,
        decode=cfg.decode,
        device=cfg.device,
        worker_start=cfg.worker_start,
        extra=dict(cfg.loader_options) if phase.loader == "stallfree" else {},
    )
    try:
        adapter = make_adapter(phase.loader, settings)
    except (ValueError, ImportError) as exc:  # e.g. a tar-only reader on a non-tar dataset
        logger.warning("rank %d: loader %s cannot run on this dataset: %s", rank, phase.loader, exc)
        return {"skipped": str(exc)}
    steps = phase.steps or cfg.steps
    metrics = RankMetrics(rank, warmup=cfg.warmup)
    grads = step.grads()
    if dist is not None and cfg.device.startswith("cuda"):
        grads = grads.to(cfg.device)
    try:
        batches = adapter.batches()
        if dist is not None:
            dist.barrier()
        metrics.start()
        perf = time.perf_counter
        for i in range(cfg.warmup + steps):
            if i == cfg.warmup:
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
        "timeline": metrics.timeline() if cfg.timeline else [],
        "stats": _jsonable(stats),
        "decode": decode,
    }


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return json.loads(json.dumps(value, default=str))


def _progress(cfg: BenchConfig, phases: list[Phase], rank: int) -> Any:
    if not cfg.progress or rank != 0:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=len(phases), desc="bench phases", unit="phase", file=sys.stderr)


def rank_main(
    cfg: BenchConfig,
    phases: list[Phase],
    rank: int,
    world: int,
    out_path: str | None,
    store_port: int | None = None,
) -> list[dict] | None:
    """Body of one rank: join the process group, run every phase, gather to rank 0.

    The group meets at the launcher's :func:`loopback_store` on ``store_port`` when given (spawned
    ranks), else at ``cfg.init_method`` (inside torchrun). Returns (on rank 0) one entry per
    phase: ``{"phase": ..., "ranks": [per-rank results]}``.
    """
    import torch
    import torch.distributed as dist

    from stallfree.harness.datasets import resolve_dataset

    torch.set_num_threads(1)
    group = None
    if world > 1:
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(cfg.local_rank if cfg.rank is not None else rank)
        timeout = datetime.timedelta(seconds=600)
        if store_port is not None:  # a client of the launcher's store: nothing listens here
            store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=cfg.init_method, rank=rank, world_size=world, timeout=timeout
            )
        group = dist
    bar = _progress(cfg, phases, rank)
    try:
        base = resolve_dataset(cfg.dataset, cfg.storage_options)
        warm = resolve_dataset(cfg.warm_from) if cfg.warm_from else None
        results = []
        for phase in phases:
            logger.info("rank %d: phase %s", rank, phase.label)
            if bar is not None:
                bar.set_postfix_str(phase.label)
            mine = _run_phase(cfg, phase, base, warm, rank, world, group)
            if bar is not None:
                bar.update(1)
            if group is not None:
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, mine)
            else:
                gathered = [mine]
            results.append({"phase": phase.as_dict(), "ranks": gathered})
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
    cfg: BenchConfig,
    phases: list[Phase],
    world: int,
    out_path: str,
    log_level: int,
    store_port: int,
) -> None:
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        rank_main(cfg, phases, rank, world, out_path, store_port)
    except BaseException as exc:
        # When one rank fails, its peers fail right after in the collective (gloo: "connection
        # closed"); the parent reports the earliest failure, the cause, not whichever it sees first.
        line = f"{type(exc).__name__}: {error_line(exc)}"
        with contextlib.suppress(OSError):
            Path(f"{out_path}.rank{rank}.err").write_text(json.dumps([time.time(), line]))
        raise


def _first_failure(out_path: str, world: int) -> tuple[int, str] | None:
    """(rank, error line) of the rank that failed first, from the files ``_spawned`` leaves."""
    seen = []
    for rank in range(world):
        with contextlib.suppress(OSError, ValueError):
            when, line = json.loads(Path(f"{out_path}.rank{rank}.err").read_text())
            seen.append((when, rank, line))
    return (min(seen)[1], min(seen)[2]) if seen else None


def run_phases(cfg: BenchConfig, phases: list[Phase]) -> list[dict] | None:
    """Run ``phases`` on ``cfg.nproc`` freshly spawned ranks, or, when ``cfg.rank`` is set (inside
    torchrun), in this process as that rank. Returns the gathered results on rank 0, else None."""
    if cfg.rank is not None:
        world = cfg.world_size or 1
        if world > 1 and not cfg.init_method:
            raise ValueError("running inside a job of several ranks needs init_method (tcp://MASTER:PORT)")
        return rank_main(cfg, phases, cfg.rank, world, None)
    if cfg.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < cfg.nproc:
            raise ValueError(
                f"--nproc {cfg.nproc} ranks on CUDA need as many GPUs; {torch.cuda.device_count()} visible"
            )
    if cfg.nproc == 1:
        return rank_main(cfg, phases, 0, 1, None)
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    store, port = loopback_store()  # held open until every rank is done
    with tempfile.TemporaryDirectory(prefix="stallfree-bench-") as tmp:
        out_path = os.path.join(tmp, "results.json")
        try:
            mp.start_processes(
                _spawned,
                args=(cfg, phases, cfg.nproc, out_path, logging.getLogger().level, port),
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


def loader_phases(cfg: BenchConfig) -> tuple[list[Phase], dict[str, str]]:
    """One cold phase per requested loader that can run here, and the reasons for those skipped."""
    from stallfree.harness.loaders import loader_available

    phases, skipped = [], {}
    for name in cfg.loaders:
        reason = loader_available(name)
        if reason:
            skipped[name] = reason
            logger.warning("skipping loader %s: %s", name, reason)
        else:
            phases.append(Phase(name))
    return phases, skipped


def _dataset_len(cfg: BenchConfig) -> int | None:
    from stallfree.harness.datasets import resolve_dataset

    try:
        return len(resolve_dataset(cfg.dataset, cfg.storage_options))
    except Exception as exc:  # informative only: the bench itself already ran on it
        logger.warning("could not read the dataset length for the report: %s", exc)
        return None


def run_bench(cfg: BenchConfig) -> dict[str, Any] | None:
    """The programmatic entry: run the loaders (and analysis / tuning when asked) and return the
    report dict (see report.build_report); None on ranks other than 0 inside torchrun."""
    cfg.validate()
    phases, skipped = loader_phases(cfg)
    probe = analyze.probe_dataset(cfg) if cfg.analyze else None
    plan = analyze.analysis_phases(cfg, probe) if cfg.analyze else {}
    extra = [p for p in plan.values() if p not in phases]  # the cold run may be a loader's own
    if cfg.tune:
        extra += tune.tune_phases(cfg)
    if not phases and not extra:
        raise ValueError(f"no requested loader can run here: {skipped}")
    started = time.time()
    gathered = run_phases(cfg, phases + extra)
    if gathered is None:
        return None
    results: dict[Phase, dict[str, Any]] = {}
    for phase, r in zip(phases + extra, gathered, strict=True):
        reason = next((x["skipped"] for x in r["ranks"] if "skipped" in x), None)
        if reason is None:
            results[phase] = r
        elif phase.purpose is Purpose.BENCH:
            skipped[phase.label] = reason
        else:
            raise ValueError(f"phase {phase.label} could not run: {reason}")
    ran = [results[p] for p in phases if p in results]
    rep = report.build_report(cfg, ran, skipped, elapsed_s=time.time() - started)
    rep["dataset_samples"] = _dataset_len(cfg)
    if cfg.analyze:
        rep["analysis"] = analyze.analyze(cfg, results, plan, probe)
    if cfg.tune:
        rep["tune"] = tune.summarize(cfg, results)
    return rep

"""Parallel sharding: plan shard boundaries up front from the listed item sizes, let worker
processes each write whole shards with the single-shard writers, then write one manifest in
shard order. The plan depends only on the items, the limits and the shuffle seed, and each shard
is written by one deterministic writer, so the output is byte-identical for any worker count,
and on any engine: the shard tasks run through a ``TaskRunner`` (``LocalRunner``: this process or
forked workers; Ray and Spark: ``stallfree/engines/``), while the plan and the manifest stay here.

Replacing a dataset (``overwrite``) is all or nothing. The new shards take names the old
dataset does not use (``Manifest.generation_stem``: ``shard-000000.tar`` or ``shard-000000.g1.tar``),
each written under a temp name and renamed by its writer; the new manifest is written only once
every shard is in place (the commit point), and the old dataset's files are removed only after
that. If anything fails before the commit, the shards this run finished are removed, no manifest is
written, and the old dataset is exactly as it was. Temp files that a killed run left behind are
removed at the start of the next (``atomic.remove_stale_temps``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import multiprocessing
import os
import posixpath
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec

from stallfree.errors import DatasetExistsError, SampleDecodeError, WriteError
from stallfree.shards import formats
from stallfree.shards.formats import Format
from stallfree.shards.manifest.model import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    files_in_use,
    generation_stem,
)
from stallfree.shards.sources.registry import Item, Source, SourceError, SourceReadError, open_source
from stallfree.storage.atomic import check_writable, parse_temp, remove_stale_temps

log = logging.getLogger(__name__)

DEFAULT_NAME = "shard-{index:06d}"
# Grouped sources (ImageFolder: one class after another) are shuffled with this seed unless the
# caller says otherwise: readers that stream shards in order (WebDataset, DALI) would otherwise
# give near-single-class batches.
DEFAULT_SHUFFLE_SEED = 0
AUTO = "auto"
_OVERLAP_HASH = True  # hash tar shards on a helper thread (benchmarks/bench_shard.py compares both)
ProgressFn = Callable[[int, int], None]  # (samples, bytes) just written


class SampleTransform(Protocol):
    """A deterministic, picklable rewrite of each sample before it is written (``stallfree shard
    --max-side``: ``gpu_decode/downscale.py``). ``apply`` returns the sample to write and how many
    of its fields it changed, or raises ``SampleDecodeError`` (the run's ``on_error`` applies);
    ``record(changed)`` is the manifest's ``transform`` entry. Shards are planned from the
    original sizes, so a shrinking transform leaves them under ``max_bytes``."""

    def apply(self, sample: dict[str, Any]) -> tuple[dict[str, Any], int]: ...

    def record(self, changed: int) -> dict[str, Any]: ...


def item_cost(item: Item, fmt: str) -> int:
    """Bytes an item will take in a shard of ``fmt`` (exact for tar when the sizes are exact)."""
    return formats.get_format(fmt).item_cost(item.sizes)


def _format(fmt: str) -> Format:
    """The registered format ``fmt``; ValueError naming the registered ones otherwise."""
    if fmt not in formats.format_names():
        raise ValueError(f"format must be {formats.choices(quote=True)}, not {fmt!r}")
    return formats.get_format(fmt)


def plan_shards(
    items: Sequence[Item],
    fmt: str = "tar",
    *,
    max_bytes: int | None = 256_000_000,
    max_samples: int | None = None,
    shuffle_seed: int | None = None,
) -> list[list[int]]:
    """Split items (indices into ``items``) into shards, in order: a shard closes before an item
    that would take it past ``max_bytes`` (an item bigger than that gets a shard of its own) or
    when it holds ``max_samples``. ``shuffle_seed`` permutes the items first (numpy PCG64)."""
    spec = _format(fmt)
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if max_samples is not None and max_samples <= 0:
        raise ValueError(f"max_samples must be positive, got {max_samples}")
    order: Sequence[int] = range(len(items))
    if shuffle_seed is not None:
        import numpy as np

        order = np.random.default_rng(shuffle_seed).permutation(len(items)).tolist()
    base = spec.shard_overhead
    limit = max_bytes if max_bytes is not None else float("inf")
    cap = max_samples if max_samples is not None else float("inf")
    shards: list[list[int]] = []
    current: list[int] = []
    used = base
    for i in order:
        cost = spec.item_cost(items[i].sizes)
        if current and (len(current) >= cap or used + cost > limit):
            shards.append(current)
            current, used = [], base
        current.append(i)
        used += cost
    if current:
        shards.append(current)
    return shards


@dataclass
class ShardResult:
    """What one worker wrote: ``info`` is None when every item of the shard was skipped."""

    index: int
    info: ShardInfo | None
    fields: list[str]
    field_types: dict[str, str] | None
    skipped: list[dict[str, str]] = field(default_factory=list)
    transformed: int = 0  # fields the transform changed


@dataclass
class ShardSummary:
    """The outcome of ``shard_dataset``: the manifest written plus speed and skip figures."""

    manifest: Manifest
    manifest_path: str
    seconds: float
    skipped: list[dict[str, Any]]

    @property
    def samples(self) -> int:
        return self.manifest.samples

    @property
    def bytes(self) -> int:
        return self.manifest.bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.manifest.format,
            "samples": self.samples,
            "shards": len(self.manifest.shards),
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "mb_per_s": round(self.bytes / 1e6 / self.seconds, 1) if self.seconds > 0 else None,
            "skipped": self.skipped,
            "shuffle_seed": self.manifest.extra.get("shuffle_seed"),
            "manifest": self.manifest_path,
            **({"transform": self.manifest.transform} if self.manifest.transform is not None else {}),
        }


@dataclass(frozen=True)
class ShardJob:
    """What every shard task of one run shares, sent once to whatever runs the tasks: the source
    (it pickles as its paths and listing), how to write, and where (``dst`` with its fsspec
    options, so a task on another machine opens the destination itself)."""

    source: Source
    format: str
    on_error: str
    schema: Any
    transform: SampleTransform | None
    dst: str
    storage_options: dict[str, Any]


@dataclass(frozen=True)
class ShardTask:
    """One planned shard: its index in the plan, its final path and the items it holds. A task is
    a pure function of the plan, so any attempt on any machine writes the same bytes."""

    index: int
    path: str
    items: list[Item]


class TaskRunner(Protocol):
    """The executor seam: runs a planned run's shard tasks somewhere (local processes, Ray, Spark;
    ``stallfree/engines/``). The plan, the names and the manifest stay on the driver
    (``shard_dataset``); a runner only writes shards, each under a temp name renamed into place.
    ``remote`` runners run tasks whose results may be lost with the task (a retried or killed
    attempt), so a failed run removes every planned shard rather than only the reported ones."""

    remote: bool

    def prepare(self, job: ShardJob) -> None:
        """Refuse, before anything is written, what the tasks could not reach."""
        ...

    def run(
        self,
        job: ShardJob,
        tasks: Sequence[ShardTask],
        on_result: Callable[[ShardResult], None],
        progress: ProgressFn | None,
    ) -> None:
        """Write every task's shard; ``on_result`` for each as it finishes; raise on the first
        task that failed (after the engine's retries)."""
        ...


def run_task(job: ShardJob, task: ShardTask, progress: ProgressFn | None = None) -> ShardResult:
    """Write one planned shard wherever this runs (a Ray or Spark task), opening the destination
    from the job's URL and options."""
    fs = fsspec.core.url_to_fs(job.dst, **job.storage_options)[0]
    return write_shard(
        job.source,
        task.items,
        task.index,
        task.path,
        job.format,
        fs,
        on_error=job.on_error,
        schema=job.schema,
        progress=progress,
        transform=job.transform,
    )


@dataclass
class LocalRunner:
    """Today's ``--workers``: in this process for one worker, forked worker processes for more."""

    workers: int = 1
    remote: bool = False

    def prepare(self, job: ShardJob) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    def run(
        self,
        job: ShardJob,
        tasks: Sequence[ShardTask],
        on_result: Callable[[ShardResult], None],
        progress: ProgressFn | None,
    ) -> None:
        workers = self.workers
        fs = fsspec.core.url_to_fs(job.dst, **job.storage_options)[0]
        if workers > 1 and "memory" in _protocols(fs):
            log.warning("memory:// lives in one process: writing with 1 worker instead of %d", workers)
            workers = 1
        if workers == 1 or len(tasks) <= 1:
            for task in tasks:
                on_result(
                    write_shard(
                        job.source,
                        task.items,
                        task.index,
                        task.path,
                        job.format,
                        fs,
                        on_error=job.on_error,
                        schema=job.schema,
                        progress=progress,
                        transform=job.transform,
                    )
                )
            return
        _run_pool(job, tasks, workers, progress, on_result)


def write_shard(
    source: Source,
    items: Sequence[Item],
    index: int,
    path: str,
    fmt: str,
    fs: fsspec.AbstractFileSystem,
    *,
    on_error: str = "raise",
    schema: Any = None,
    progress: ProgressFn | None = None,
    transform: SampleTransform | None = None,
) -> ShardResult:
    """Write one shard from ``items``; unreadable items (and samples ``transform`` rejects) raise
    or are skipped per ``on_error``. A shard whose items were all skipped is not written."""
    spec = formats.get_format(fmt)
    writer = spec.writer(path, fs, schema=schema, overlap_hash=_OVERLAP_HASH)
    skipped: list[dict[str, str]] = []
    transformed = 0
    try:
        # Read inline, one sample at a time: a read-ahead thread (tried) cost more than it saved
        # here (a third thread competing with the hash thread for 2 cores, a queue hop per sample,
        # more sample memory in flight to fault in); the kernel already reads ahead within a file.
        for item, sample in zip(items, source.read_many(items), strict=True):
            if transform is not None and not isinstance(sample, SourceReadError):
                try:
                    sample, changed = transform.apply(sample)
                    transformed += changed
                except SampleDecodeError as exc:  # named in the reason: a skip lists the reason
                    sample = SourceReadError(str(exc), path=item.name)
            if isinstance(sample, SourceReadError):
                if on_error == "raise":
                    raise sample
                log.warning("skipping %s", sample)
                skipped.append({"source": item.name, "error": sample.reason})
                continue
            n = writer.write(sample)
            if progress is not None:
                progress(1, n)
        if writer.samples == 0:
            writer.abort()
            return ShardResult(index, None, [], None, skipped, transformed)
        info = writer.close()
    except BaseException:
        writer.abort()
        # a shard whose rename failed after its sidecars (a tar's .idx and .sums) were renamed into place
        for sidecar in spec.sidecars(path):
            with contextlib.suppress(Exception):
                fs.rm_file(sidecar)
        raise
    return ShardResult(index, info, writer.fields, writer.field_types, skipped, transformed)


# -- worker processes -----------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this worker when its parent dies (even by SIGKILL), so a worker
    of a killed run never renames a shard into place behind a later run's back."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _init_worker(source: Source, fs_url: str, storage_options: dict, progress_q: Any, parent: int) -> None:
    _die_with_parent(parent)
    _WORKER["source"] = source
    _WORKER["fs"] = fsspec.core.url_to_fs(fs_url, **storage_options)[0]
    _WORKER["q"] = progress_q


def _worker_shard(
    items: list[Item],
    index: int,
    path: str,
    fmt: str,
    on_error: str,
    schema: Any,
    transform: SampleTransform | None = None,
) -> ShardResult:
    q = _WORKER["q"]
    pending = [0, 0, time.monotonic()]

    def report(samples: int, nbytes: int) -> None:
        pending[0] += samples
        pending[1] += nbytes
        now = time.monotonic()
        if now - pending[2] > 0.2:
            q.put((pending[0], pending[1]))
            pending[:] = [0, 0, now]

    try:
        return write_shard(
            _WORKER["source"],
            items,
            index,
            path,
            fmt,
            _WORKER["fs"],
            on_error=on_error,
            schema=schema,
            progress=report,
            transform=transform,
        )
    finally:
        if pending[0] or pending[1]:
            q.put((pending[0], pending[1]))


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork: workers inherit the source without re-importing ``__main__`` (``python -m stallfree``
    # has no main guard); the pool is started before any thread of ours exists.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


# -- the whole job ---------------------------------------------------------------------------------
def resolve_shuffle(source: Source, shuffle_seed: int | str | None) -> int | None:
    """The seed to shuffle with: ``"auto"`` is ``DEFAULT_SHUFFLE_SEED`` for a grouped source
    (``source.grouped``) and None (source order) for the rest; an int or None as given."""
    if shuffle_seed == AUTO:
        return DEFAULT_SHUFFLE_SEED if getattr(source, "grouped", False) else None
    if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)):
        raise ValueError(f"shuffle_seed must be an int, None or 'auto', not {shuffle_seed!r}")
    return shuffle_seed


def shard_dataset(
    source: Source | Any,
    dst: str,
    *,
    format: str = "tar",
    max_bytes: int | None = 256_000_000,
    max_samples: int | None = None,
    workers: int = 1,
    shuffle_seed: int | str | None = AUTO,
    on_error: str = "raise",
    name: str = DEFAULT_NAME,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    on_plan: Callable[[int, int, int], None] | None = None,
    transform: SampleTransform | None = None,
    executor: TaskRunner | None = None,
    **storage_options: Any,
) -> ShardSummary:
    """Shard ``source`` into ``dst`` (any fsspec URL). ``source`` is a ``Source``, or anything
    ``open_source`` takes (a path, a ``datasets.Dataset`` / ``IterableDataset``).
    ``shuffle_seed``: ``"auto"`` shuffles grouped sources (ImageFolder, grouped files, Hugging
    Face rows sorted by ClassLabel) with ``DEFAULT_SHUFFLE_SEED`` and keeps the order of the
    rest; an int shuffles with that seed; None keeps source order. The seed used is the manifest's ``shuffle_seed``.
    ``on_plan(samples, shards, bytes)`` is called once the plan is made; ``progress(samples,
    bytes)`` as samples are written; ``transform`` rewrites each sample before it is written
    (recorded in the manifest). ``executor`` runs the shard tasks (``stallfree.engines``: Ray,
    Spark); by default ``workers`` local processes. The output is the same bytes on any."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if not isinstance(source, Source):
        source = open_source(source, on_error=on_error)
    shuffle_seed = resolve_shuffle(source, shuffle_seed)
    runner: TaskRunner = executor if executor is not None else LocalRunner(workers)
    if executor is None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    spec = _format(format)
    try:
        first, second = name.format(index=0), name.format(index=1)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"bad shard name pattern {name!r}: {exc!r}") from None
    if first == second or not first or first.startswith("/") or "/" in first:
        raise ValueError(f"shard name pattern {name!r} must be a plain file name containing '{{index}}'")
    t0 = time.perf_counter()
    fs, root = fsspec.core.url_to_fs(dst, **storage_options)
    root = root.rstrip("/") or root
    check_destination(source, fs, root, dst, overwrite=overwrite)
    runner.prepare(ShardJob(source, format, on_error, None, transform, dst, dict(storage_options)))
    manifest_path = posixpath.join(root, MANIFEST_NAME)
    if fs.exists(manifest_path) and not overwrite:
        raise DatasetExistsError(f"{dst} already holds a dataset ({MANIFEST_NAME})")
    check_writable(fs, root)
    remove_stale_temps(fs, root)
    old, in_use = files_in_use(fs, root)

    items = source.items()
    skipped: list[dict[str, Any]] = list(source.skipped)
    if not items:
        raise SourceError(
            f"no samples to shard in the {source.kind} source"
            + (f" ({len(skipped)} unreadable item(s) skipped)" if skipped else "")
        )
    plan = plan_shards(items, format, max_bytes=max_bytes, max_samples=max_samples, shuffle_seed=shuffle_seed)
    if on_plan is not None:
        on_plan(len(items), len(plan), sum(spec.item_cost(it.sizes) for it in items))
    schema = spec.source_schema(source)
    paths = [posixpath.join(root, rel) for rel in shard_names(name, len(plan), format, root, in_use)]
    job = ShardJob(source, format, on_error, schema, transform, dst, dict(storage_options))
    tasks = [ShardTask(i, paths[i], [items[j] for j in shard]) for i, shard in enumerate(plan)]

    results: list[ShardResult] = []
    try:
        runner.run(job, tasks, results.append, progress)
    except BaseException:
        _remove_written(fs, spec, _undo_list(runner, results, tasks), root, in_use)
        raise

    results.sort(key=lambda r: r.index)
    shards = [r.info for r in results if r.info is not None]
    fields: dict[str, None] = {}
    field_types: dict[str, str] = {}
    for r in results:
        fields.update(dict.fromkeys(r.fields))
        if r.field_types:
            for k, v in r.field_types.items():
                field_types.setdefault(k, v)
        skipped.extend(r.skipped)
    manifest = Manifest(
        version=FORMAT_VERSION,
        format=format,
        fields=list(fields),
        shards=shards,
        classes=source.classes,
        skipped=skipped,
        field_types=field_types if spec.typed_fields else None,
        checksums=spec.checksums,  # every tar writes its .sums
        transform=transform.record(sum(r.transformed for r in results)) if transform is not None else None,
        extra=_provenance(source, shuffle_seed),
    )
    try:
        written = manifest.commit(fs, root, replacing=old)
    except BaseException:
        _remove_written(fs, spec, _undo_list(runner, results, tasks), root, in_use)
        raise
    return ShardSummary(manifest, written, time.perf_counter() - t0, skipped)


def source_locations(source: Source) -> list[tuple[fsspec.AbstractFileSystem, str]]:
    """Where ``source`` reads from, as (filesystem, path) pairs: its directory (``root``), its
    files (``paths``) or its URL (``url``: a dataset read through ``open_dataset``). Empty for a
    source held in memory (a ``datasets.Dataset``)."""
    found: list[str] = []
    for attr in ("root", "url"):
        value = getattr(source, attr, None)
        if isinstance(value, (str, os.PathLike)):
            found.append(os.fspath(value))
    paths = getattr(source, "paths", None)
    if isinstance(paths, (list, tuple)):
        found += [os.fspath(p) for p in paths if isinstance(p, (str, os.PathLike))]
    out = []
    for where in found:
        try:
            fs, path = fsspec.core.url_to_fs(where)
        except (ImportError, ValueError):  # a store this process cannot name: nothing to compare
            continue
        if posixpath.basename(path) == MANIFEST_NAME:  # a dataset given by its manifest: its directory
            path = posixpath.dirname(path)
        out.append((fs, _canonical(fs, path)))
    return out


def _canonical(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` comparable with others of its store: a local one absolute with symbolic links
    resolved (``./ds`` and a link to it are one directory), any other without a trailing '/'."""
    if "file" in _protocols(fs) or "local" in _protocols(fs):
        return os.path.realpath(path)
    return path.rstrip("/") or path


def _within(inner: str, outer: str) -> bool:
    """``inner`` is ``outer`` or lies under it."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def check_destination(
    source: Source, fs: fsspec.AbstractFileSystem, root: str, dst: str, *, overwrite: bool
) -> None:
    """Refuse, before anything is written, a destination that is the source or lies inside it
    (the shards would land among the files being read, and the next run would read them back
    as samples), and with ``overwrite`` a destination that holds the source (replacing it
    deletes what is being read). ``shard DS DS --overwrite`` once replaced a dataset by five
    file-samples of itself and deleted its shards."""
    target = _canonical(fs, root)
    for src_fs, where in source_locations(source):
        if not set(_protocols(fs)) & set(_protocols(src_fs)):
            continue  # another store: nothing shared
        if _within(target, where):
            same = "is" if target == where else "lies inside"
            raise WriteError(
                f"the destination {dst} {same} the source {where}: the shards would be written "
                "into the data being read (write them to a directory outside it)",
            )
        if overwrite and _within(where, target):
            raise WriteError(
                f"the source {where} lies inside the destination {dst}: replacing that dataset "
                "(overwrite) would delete data being read (write the shards elsewhere)"
            )


def _provenance(source: Source, shuffle_seed: int | None) -> dict[str, Any]:
    """Manifest entries saying how the samples were ordered (``shuffle_seed``: null for source
    order) and, for a source with named classes in a column of its own (a ``datasets``
    ClassLabel), which field ``classes`` names (``class_field``; ImageFolder's is ``cls``)."""
    extra: dict[str, Any] = {"shuffle_seed": shuffle_seed}
    class_field = getattr(source, "class_field", None)
    if class_field is not None and source.classes is not None:
        extra["class_field"] = class_field
    return extra


def _run_pool(
    job: ShardJob,
    tasks: Sequence[ShardTask],
    workers: int,
    progress: ProgressFn | None,
    on_result: Callable[[ShardResult], None],
) -> None:
    """Run the tasks on worker processes, reporting each shard as it finishes (so that on
    failure the caller knows which finished shards to remove)."""
    ctx = _mp_context()
    progress_q = ctx.SimpleQueue() if ctx.get_start_method() == "fork" else ctx.Manager().Queue()
    with ProcessPoolExecutor(
        max_workers=min(workers, len(tasks)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(job.source, job.dst, job.storage_options, progress_q, os.getpid()),
    ) as pool:
        futures: set[Future] = {
            pool.submit(
                _worker_shard, task.items, task.index, task.path, job.format, job.on_error, job.schema,
                job.transform,
            )
            for task in tasks
        }  # fmt: skip
        try:
            while futures:
                done, futures = wait(futures, timeout=0.1, return_when=FIRST_EXCEPTION)
                _drain(progress_q, progress)
                error: BaseException | None = None
                for fut in done:  # keep every finished shard (so it can be removed) before raising
                    try:
                        on_result(fut.result())
                    except BaseException as exc:  # noqa: BLE001 - re-raised below
                        error = error or exc
                if error is not None:
                    raise error
        except BaseException:
            for fut in futures:
                fut.cancel()
            for fut in futures:  # let running shards finish or abort so their files can be removed
                with contextlib.suppress(BaseException):
                    on_result(fut.result())
            raise
        _drain(progress_q, progress)


def _drain(q: Any, progress: ProgressFn | None) -> None:
    while not q.empty():
        samples, nbytes = q.get()
        if progress is not None:
            progress(samples, nbytes)


def shard_names(name: str, count: int, fmt: str, root: str, in_use: set[str]) -> list[str]:
    """File names for ``count`` shards: ``name`` formatted, in the first generation
    (``generation_stem``) none of whose files (shards and their sidecars) is in ``in_use``."""
    spec = formats.get_format(fmt)
    for generation in itertools.count():
        rels = [generation_stem(name.format(index=i), generation) + spec.suffix for i in range(count)]
        paths = [posixpath.normpath(posixpath.join(root, rel)) for rel in rels]
        paths += [side for p in paths for side in spec.sidecars(p)]
        if in_use.isdisjoint(paths):
            return rels
    raise AssertionError("unreachable")


def _undo_list(
    runner: TaskRunner, results: list[ShardResult], tasks: Sequence[ShardTask]
) -> list[ShardResult]:
    """What a failed run removes: the shards reported written; for a remote runner every planned
    one (an attempt may have renamed its shard into place and died before reporting it)."""
    if not getattr(runner, "remote", False):
        return results
    return [ShardResult(t.index, ShardInfo(posixpath.basename(t.path), 0, 0), [], None) for t in tasks]


def _remove_written(
    fs: fsspec.AbstractFileSystem, spec: Format, results: list[ShardResult], root: str, in_use: set[str]
) -> None:
    """Undo a failed run: remove the shards (and their sidecars) it already finished, never a
    file of the dataset it was to replace; and the temp files of those names, which a task a
    remote runner cancelled (killed mid-write, so it could not clean up) leaves behind."""
    names = {
        posixpath.basename(p) for r in results if r.info is not None for p in _shard_files(spec, root, r)
    }
    try:
        listed = fs.ls(root, detail=False) if names else []
    except (FileNotFoundError, NotADirectoryError):
        listed = []
    for path in listed:
        base = posixpath.basename(path)
        if parse_temp(path) is not None and base[1:].split(".tmp-", 1)[0] in names:
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - the first error is the one to report
                log.warning("could not remove %s after a failed run: %s", path, exc)
    for r in results:
        if r.info is None:
            continue
        path = posixpath.join(root, r.info.path)
        for p in [path, *spec.sidecars(path)]:
            if posixpath.normpath(p) in in_use:
                continue
            try:
                fs.rm_file(p)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - the first error is the one to report
                log.warning("could not remove %s after a failed run: %s", p, exc)
        log.info("removed %s after a failed run", path)


def _shard_files(spec: Format, root: str, r: ShardResult) -> list[str]:
    path = posixpath.join(root, r.info.path)
    return [path, *spec.sidecars(path)]


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)

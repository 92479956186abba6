"""What the loader accepts, as protocols in one place: contracts, not probes.

Every question the loader asks of an object it was handed (the dataset, ``decode=``, ``cache=``,
a sampler) is asked here, through a runtime-checkable protocol or one small function, and
nowhere else in stallfree/loader (tests/loader/test_contracts.py fails on a new ``hasattr`` /
``getattr(x, "name")`` probe elsewhere). Before, ~49 probes spread over nine modules decided the
same things several times, slightly differently (``is_sharded`` needed three attributes, the read
path one of them). ``decode=`` is resolved once into a frozen :class:`DecodePlacement`; the worker
and main plans take their decode fields from it.

The cache protocol is the cache package's own (``stallfree.cache.base.Cache``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stallfree.cache.base import Cache
from stallfree.errors import ShardError
from stallfree.storage.fs import is_local

logger = logging.getLogger(__name__)

__all__ = [
    "BatchDecoder",
    "BatchedReads",
    "Cache",
    "CollatedReads",
    "DecodePlacement",
    "KeyedSource",
    "ShardedSource",
    "SelfOrdering",
    "place_decode",
]


# -- datasets ---------------------------------------------------------------------------------
@runtime_checkable
class BatchedReads(Protocol):
    """Reads a batch of samples in one call (grouped by shard, neighbours coalesced)."""

    def get_many(self, indices: Sequence[int]) -> list[Any]: ...


@runtime_checkable
class CollatedReads(Protocol):
    """The stallfree batched-read protocol: also a collated ``get_batch`` returning exactly
    ``default_collate(get_many(indices))`` (a ``get_batch`` alone is never called: an unrelated
    method of that name on a torch Dataset must not be mistaken for it)."""

    def get_many(self, indices: Sequence[int]) -> list[Any]: ...

    def get_batch(self, indices: Sequence[int]) -> Any: ...


@runtime_checkable
class ShardedSource(Protocol):
    """A stallfree sharded dataset (or anything offering the same contract): shard sizes for
    block order, a content fingerprint for cache keys, batched reads."""

    shard_sizes: Sequence[int]
    fingerprint: str

    def get_many(self, indices: Sequence[int]) -> list[Any]: ...


@runtime_checkable
class OpenedFromUrl(Protocol):
    """A dataset opened from a URL (``open_dataset``): a resume state names it, so ``stallfree
    trace STATE`` can open it again."""

    url: str


@runtime_checkable
class KeyedSource(Protocol):
    """Tells a sample's ``__key__`` from its index without reading it (None: it cannot cheaply)."""

    def key_of(self, index: int) -> str | None: ...


@runtime_checkable
class OnFilesystem(Protocol):
    fs: Any  # an fsspec filesystem


@runtime_checkable
class SelfOrdering(Protocol):
    """A dataset whose positions are already in its epoch's order (a mixture): the loader reads
    them in sequence, split over ranks, and sets the epoch in every process that reads.
    Only one with ``ordered`` true counts (see :func:`orders_itself`)."""

    ordered: bool

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class ResumableMixture(Protocol):
    """A self-ordering dataset whose resume state the loader saves and checks."""

    def state(self) -> dict[str, Any]: ...

    def check_state(self, state: dict[str, Any], *, allow_reweight: bool = False) -> None: ...


@runtime_checkable
class CountsSources(Protocol):
    """Samples delivered per source over a range of positions (a mixture's ``stats()['mix']``)."""

    def counts(self, start: int, stop: int) -> Any: ...


@runtime_checkable
class ReportsShares(Protocol):
    """Achieved per-source fractions beside the targets over a range of positions (a
    mixture's ``stats()['mix']['fractions']``)."""

    def fractions(self, start: int, stop: int, window: int) -> Any: ...


@runtime_checkable
class EpochAware(Protocol):
    """A sampler (or batch sampler's sampler) told the epoch, as DistributedSampler is."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class ConcurrentShardSource(Protocol):
    """A sharded dataset that opens and reads its shards concurrently on a pool it is lent
    (``stallfree.shards.open.ShardedDataset``; the loader's shardio.py lends each worker one)."""

    fs: Any

    def warm(self, shards: Sequence[int], executor: Any) -> None: ...

    def shards_of(self, indices: Sequence[int]) -> list[int]: ...

    def get_many(self, indices: Sequence[int], executor: Any = None) -> list[Any]: ...


@runtime_checkable
class Collates(Protocol):
    """A dataset with its own collate (a mixture batches by source: mix/collate.py)."""

    def collate(self, samples: list[Any]) -> Any: ...


@runtime_checkable
class WrapsSampler(Protocol):
    """A batch sampler over a sampler (torch's BatchSampler)."""

    sampler: Any


def own_collate_of(dataset: Any) -> Callable[[list[Any]], Any] | None:
    return dataset.collate if isinstance(dataset, Collates) else None


def samplers_of(sampler: Any, batch_sampler: Any) -> list[Any]:
    """The sampler and the batch sampler's own sampler (each may need ``set_epoch``)."""
    inner = batch_sampler.sampler if isinstance(batch_sampler, WrapsSampler) else None
    return [s for s in (sampler, inner) if s is not None]


def is_namedtuple(obj: Any) -> bool:
    """A namedtuple in a batch (default_collate rebuilds those by their fields)."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_sharded(dataset: Any) -> bool:
    return isinstance(dataset, ShardedSource)


def orders_itself(dataset: Any) -> bool:
    return isinstance(dataset, SelfOrdering) and bool(dataset.ordered)


def is_remote(dataset: Any) -> bool:
    """A dataset on anything but the local filesystem (the one rule: storage.fs.is_local)."""
    return isinstance(dataset, OnFilesystem) and dataset.fs is not None and not is_local(dataset.fs)


def url_of(dataset: Any) -> str | None:
    url = dataset.url if isinstance(dataset, OpenedFromUrl) and isinstance(dataset, ShardedSource) else None
    return url if isinstance(url, str) and url else None


def fingerprint_of(dataset: Any) -> str | None:
    fp = dataset.fingerprint if isinstance(dataset, ShardedSource) else None
    return fp if isinstance(fp, str) and fp else None


def shard_sizes_of(dataset: Any) -> Sequence[int] | None:
    return dataset.shard_sizes if isinstance(dataset, ShardedSource) else None


def reads_batches(dataset: Any) -> bool:
    return isinstance(dataset, BatchedReads)


# The two lookups below run once per batch in a worker: they read the attributes directly (the
# same test as isinstance of BatchedReads / CollatedReads), because a runtime-checkable
# protocol's isinstance cost 40-53 us a call here (timeit, loaded machine): more than a token
# batch's whole hand-over.
def batch_read_of(dataset: Any) -> Callable[[Sequence[int]], list[Any]] | None:
    """The dataset's batched read: ``get_many``, else torch's ``__getitems__`` (when set)."""
    get_many = getattr(dataset, "get_many", None)
    return get_many if callable(get_many) else getitems_of(dataset)


def collated_read_of(dataset: Any) -> Callable[[Sequence[int]], Any] | None:
    """The dataset's ``get_batch``, where it speaks the whole CollatedReads protocol."""
    get_batch = getattr(dataset, "get_batch", None)
    if callable(get_batch) and callable(getattr(dataset, "get_many", None)):
        return get_batch
    return None


def getitems_of(dataset: Any) -> Callable[[Sequence[Any]], list[Any]] | None:
    """torch's ``__getitems__`` hook as torch's fetcher reads it: the attribute, when truthy
    (``__getitems__ = None`` turns it off)."""
    fn = getattr(dataset, "__getitems__", None)
    return fn or None


def defines_getitems(dataset: Any) -> bool:
    """Whether the dataset has a ``__getitems__`` at all (set or turned off)."""
    return hasattr(dataset, "__getitems__")


def key_of(dataset: Any, index: Any) -> str | None:
    """The sample's key without reading it, where the dataset can tell; never raises (it is
    asked while reporting another error)."""
    if not isinstance(dataset, KeyedSource) or not isinstance(index, int):
        return None
    try:
        key = dataset.key_of(index)
    except Exception:  # noqa: BLE001 - naming a failure must not fail
        logger.debug("key_of(%d) failed", index, exc_info=True)
        return None
    return key if isinstance(key, str) else None


def failed_key(dataset: Any, index: Any, exc: BaseException | None) -> str | None:
    """The key of a sample whose read failed: the dataset's ``key_of``, else the key the read's
    own error names (a ShardError knows the member it was parsing), else None."""
    key = key_of(dataset, index)
    if key is None and isinstance(exc, ShardError) and exc.key is not None:
        key = str(exc.key)
    return key


def sample_key(sample: Any) -> str | None:
    """A sample dict's ``__key__`` (as a string), or None."""
    if isinstance(sample, dict) and "__key__" in sample:
        return str(sample["__key__"])
    return None


def set_sampler_epoch(samplers: Sequence[Any], epoch: int) -> None:
    for s in samplers:
        if isinstance(s, EpochAware):
            s.set_epoch(epoch)


def mixture_state(dataset: Any) -> dict[str, Any] | None:
    return dataset.state() if orders_itself(dataset) and isinstance(dataset, ResumableMixture) else None


def mixture_counts(dataset: Any) -> Callable[[int, int], Any] | None:
    return dataset.counts if orders_itself(dataset) and isinstance(dataset, CountsSources) else None


# -- decoders ---------------------------------------------------------------------------------
@runtime_checkable
class BatchDecoder(Protocol):
    """Decodes a whole batch of raw samples; one that says ``runs_in_workers`` (and accepts
    ``alloc=``) runs in the workers, straight into the shared slot; otherwise in the main process."""

    def decode_batch(self, samples: list[Any], *, seed: int) -> Any: ...


@runtime_checkable
class RunsInWorkers(Protocol):
    runs_in_workers: bool


@runtime_checkable
class ThreadedDecoder(Protocol):
    """Told its worker's share of the cores."""

    def use_threads(self, n: int) -> None: ...


@runtime_checkable
class RestartsThreads(Protocol):
    """A threaded batch decoder whose ``close()`` only stops its threads (``restarts_threads``
    true): its next decode starts them again, so the main process may decode with it and then
    fork workers (inline_first.py)."""

    restarts_threads: bool

    def use_threads(self, n: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class FinishingDecoder(Protocol):
    """Has a last step after the device copy (uint8 -> float), run on the copy's stream."""

    needs_finish: bool

    def finish(self, batch: Any) -> Any: ...


@runtime_checkable
class StageCached(Protocol):
    """A per-sample decode whose output may be cached under ``cache_stage``."""

    cache_stage: str


@runtime_checkable
class ReportsStats(Protocol):
    def stats(self) -> dict[str, Any]: ...


DECODE_WHERE = ("none", "sample", "main", "workers")


@dataclass(frozen=True)
class DecodePlacement:
    """``decode=`` resolved once: what it is and where it runs.

    ``where``: ``none``; ``sample`` (a per-sample callable, mapped in the workers); ``main`` (a
    batch decoder in the main process: workers send raw samples); ``workers`` (a batch decoder in
    the workers, into the slot)."""

    where: str
    decoder: Any = None

    def __post_init__(self) -> None:
        if self.where not in DECODE_WHERE:
            raise ValueError(f"decode placement must be one of {DECODE_WHERE}, got {self.where!r}")

    @property
    def batch(self) -> bool:
        """A batch decoder (in either process)."""
        return self.where in ("main", "workers")

    @property
    def map_fn(self) -> Any:
        return self.decoder if self.where == "sample" else None

    @property
    def in_workers(self) -> Any:
        return self.decoder if self.where == "workers" else None

    @property
    def in_main(self) -> Any:
        return self.decoder if self.where == "main" else None

    @property
    def send_raw(self) -> bool:
        return self.where == "main"

    @property
    def cache_stage(self) -> str | None:
        dec = self.decoder
        return dec.cache_stage if self.where == "sample" and isinstance(dec, StageCached) else None

    @property
    def finish(self) -> Callable[[Any], Any] | None:
        dec = self.decoder
        return dec.finish if isinstance(dec, FinishingDecoder) and dec.needs_finish else None

    @property
    def threaded(self) -> Any:
        """The worker-side decoder to tell its share of cores (None: none)."""
        dec = self.in_workers
        return dec if isinstance(dec, ThreadedDecoder) else None

    def stats(self) -> dict[str, Any] | None:
        """The decoder's own stats (None: it keeps none, or they failed: they are informational)."""
        dec = self.decoder
        if not isinstance(dec, ReportsStats):
            return None
        try:
            return dec.stats()
        except Exception:  # noqa: BLE001 - stats are informational
            logger.debug("decoder stats failed", exc_info=True)
            return None


@runtime_checkable
class BindsDataset(Protocol):
    """A decoder that reads what the dataset says of its fields (``ImageDecode`` takes its label
    field from the manifest's ``class_field``), told once per plan."""

    def bind_dataset(self, dataset: Any) -> None: ...


def bind_decode(decode: Any, dataset: Any) -> None:
    """Tell ``decode`` which dataset it decodes, when it asks to know (``BindsDataset``)."""
    if isinstance(decode, BindsDataset):
        decode.bind_dataset(dataset)


def place_decode(decode: Any, num_workers: int) -> DecodePlacement:
    """Where ``decode=`` runs: a batch decoder in the workers when it says it can
    (``runs_in_workers``: a CPU decoder, picklable) and there are workers, else in the main
    process (GPU decoders stay with the device); any other callable per sample, in the workers."""
    if decode is None:
        return DecodePlacement("none")
    if isinstance(decode, BatchDecoder):
        in_workers = num_workers > 0 and isinstance(decode, RunsInWorkers) and bool(decode.runs_in_workers)
        return DecodePlacement("workers" if in_workers else "main", decode)
    if not callable(decode):
        raise TypeError(
            f"decode= must be a callable (sample -> sample) or have decode_batch(samples, *, seed), "
            f"got {type(decode).__name__}"
        )
    return DecodePlacement("sample", decode)


def wants_concurrency(dataset: Any) -> bool:
    """True for a remote (non-local filesystem) sharded dataset that reads shards concurrently."""
    if not isinstance(dataset, ConcurrentShardSource):
        return False
    try:
        return is_remote(dataset)
    except Exception:  # noqa: BLE001 - an unreachable store: plain reads report the error
        return False

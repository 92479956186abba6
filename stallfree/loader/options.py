"""The loader's arguments as one frozen, self-validating value, and the planner: a pure function
from (dataset, options) to what the loader will do.

Before, ``DataLoader.__init__`` was the planner: 125 lines, 33 arguments, 23 mode branches, and
``state_dict`` branched on the mode again. Now ``__init__`` lets torch validate torch's
arguments, builds a :class:`LoaderOptions` (which validates ours, and carries the facts of
torch's and of this process the plan depends on), and calls :func:`plan`, which decides the
mode, the epoch order and where ``decode=`` runs, refuses combinations that cannot work, and
builds the index source, the ``WorkerPlan`` and the ``MainPlan`` the loader then only runs. The
index source carries the resume state, so saving and restoring it has no mode branch either.
Table tests: tests/loader/test_options.py, tests/loader/test_planner.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from stallfree.loader import contracts
from stallfree.loader.assembler import check_max_failures
from stallfree.loader.contracts import DecodePlacement
from stallfree.loader.epoch import order as order_mod
from stallfree.loader.epoch.indices import IndexSource, OrderIndices, SamplerIndices, StreamIndices
from stallfree.loader.epoch.world import World
from stallfree.loader.plan import MainPlan, WorkerPlan
from stallfree.storage.staging import Staging

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip", "warn")
MODES = ("fast", "sampler", "iterable")


@dataclass(frozen=True)
class LoaderOptions:
    """Everything the plan is chosen from. The first block is torch's (as torch's DataLoader
    validated them); the rest are our keyword-only options, checked here."""

    batch_size: int | None = 1
    shuffle: bool | None = None
    custom_sampler: bool = False  # sampler= or batch_sampler= was given
    num_workers: int = 0
    iterable: bool = False  # an IterableDataset (it decides what each worker yields)
    drop_last: bool = False
    collate_fn: Any = None  # what torch chose or was given; None: its default_collate
    auto_collation: bool = True  # torch batches samples (a batch sampler is set)
    index_sampler: Any = None  # what torch's iterator draws indices from (sampler mode)
    sampler: Any = None
    generator: Any = None
    worker_init_fn: Any = None
    prefetch_factor: int | None = None
    in_order: bool = True
    pin_memory: bool = False
    timeout: float = 0
    # Facts of this process, read at the edge (DataLoader.__init__) so plan() stays pure.
    job_world: World = World(0, 1)  # torch.distributed's world (used unless ``world`` is given)
    cuda: bool = False  # torch.cuda.is_available()
    worker_cores: int = 1  # cores each worker may give decode threads (plan.worker_cores)
    seed: int | None = None
    cache: Any = None
    decode: Any = None
    device: Any = None
    on_error: str = "raise"
    max_failures: int | float | None = None
    order: str = "auto"
    world: World | None = None  # an explicit world (None: torch.distributed's, or one process)
    uneven: str = "pad"
    window: int = 8
    worker_timeout: float | None = 300.0
    decode_threads: int | None = None
    fetch_threads: int = 1
    autotune: bool = False
    memory_budget: int = 1 << 30
    # None: stage whole shards node-locally for block order over remote shards; False: never;
    # a directory, or a shards.staging.Staging (where, how many bytes at most)
    staging: Any = None
    record_keys: str | None = None  # a directory: each rank logs the positions it delivers (epoch/record.py)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.order != "auto" and self.order not in order_mod.order_names():
            names = order_mod.order_names()
            raise ValueError(f"order must be 'auto' or one of {names}, got {self.order!r}")
        if self.uneven not in order_mod.UNEVEN:
            raise ValueError(f"uneven must be one of {order_mod.UNEVEN}, got {self.uneven!r}")
        check_max_failures(self.max_failures)
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {self.decode_threads}")
        if self.fetch_threads < 1:
            raise ValueError(f"fetch_threads must be >= 1, got {self.fetch_threads}")
        if self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be > 0 bytes, got {self.memory_budget}")
        if not (self.staging is None or isinstance(self.staging, bool | str | Staging)):
            raise ValueError(f"staging must be None, a bool, a directory or a Staging, got {self.staging!r}")
        if self.record_keys is not None and (not isinstance(self.record_keys, str) or not self.record_keys):
            raise ValueError(f"record_keys must be a directory (a path string), got {self.record_keys!r}")
        if self.iterable and (self.cache is not None or self.decode is not None):
            raise ValueError("cache= and decode= need a map-style dataset (one with __getitem__ and __len__)")

    @property
    def ours(self) -> bool:
        """One of our own options that only our order serves was given."""
        return any(
            x is not None
            for x in (self.seed, self.cache, self.decode, self.world, self.device, self.record_keys)
        )


@dataclass(frozen=True)
class LoaderPlan:
    """What a loader does, decided once at construction (see :func:`plan`): the mode and order
    chosen, where ``decode=`` runs, and the three values the loader runs on: where indices come
    from (``source``, which keeps the resume state), what each worker does (``worker``) and what
    the main process does with each batch (``main``). The only fields set later are per epoch
    (``dataclasses.replace``): the workers' base seed and the epoch's failure budget."""

    mode: str  # fast (our order and rank split) | sampler (a sampler through our workers) | iterable
    order: str  # the epoch order in fast mode (order.py); "sequential" otherwise
    decode: DecodePlacement
    ordered: bool  # the dataset orders itself (a mixture): read in sequence, epoch set in workers
    seed: int | None = None  # None: to be drawn (fast mode, no seed=, one rank): see ``needs_seed``
    world: World = World(0, 1)
    device: torch.device | None = None
    source: IndexSource | None = None
    worker: WorkerPlan | None = None
    main: MainPlan | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def fast(self) -> bool:
        return self.mode == "fast"

    @property
    def needs_seed(self) -> bool:
        """The order needs a seed nobody gave: the caller draws one (torch's RNG, or ``generator``)
        and passes it to :meth:`with_seed`; drawn only then, so torch's RNG advances as before."""
        return self.seed is None

    def with_seed(self, seed: int) -> LoaderPlan:
        """The same plan under another seed (a drawn one, or a restored state's)."""
        source = self.source.reseeded(int(seed)) if self.source is not None else None
        return replace(self, seed=int(seed), source=source)


def plan(dataset: Any, options: LoaderOptions) -> LoaderPlan:
    """The mode, order, decode placement, index source, worker plan and main plan for
    ``dataset`` under ``options``; raises ValueError for combinations that cannot work.

    - ``fast``: a map-style dataset with no sampler and a batch size, when shuffled, sharded,
      self-ordering, or given one of our options (``seed``/``cache``/``decode``/``world``/``device``).
    - ``sampler``: any other map-style dataset: torch's sampler rules, on our workers.
    - ``iterable``: an ``IterableDataset``, on torch's own machinery.

    ``order="auto"`` is ``block`` for a shuffled remote sharded dataset (whole shards per read),
    ``global`` when shuffled otherwise, ``sequential`` unshuffled; a mixture is always read in
    sequence (its positions are already interleaved and shuffled per epoch).
    """
    o = options
    ordered = contracts.orders_itself(dataset)
    sharded = contracts.is_sharded(dataset)
    fast = (
        not o.iterable
        and not o.custom_sampler
        and o.batch_size is not None
        and (bool(o.shuffle) or sharded or o.ours or ordered)
    )
    mode = "fast" if fast else ("iterable" if o.iterable else "sampler")
    contracts.bind_decode(o.decode, dataset)  # before the plan pickles it into the workers
    placement = contracts.place_decode(o.decode, o.num_workers)
    if placement.batch and o.batch_size is None:
        raise ValueError("a decode_batch decoder needs batch_size set (it decodes whole batches)")
    order = o.order
    if ordered:
        if o.cache is not None:
            raise ValueError(
                "cache= with a mixture: a position holds another sample each epoch; cache its sources"
            )
        if order not in ("auto", "sequential") or o.shuffle:
            logger.info("a mixture orders itself (interleaved, seeded per epoch): read in sequence")
        order = "sequential"
    elif order == "auto":
        remote = sharded and contracts.is_remote(dataset)
        order = ("block" if remote else "global") if o.shuffle else "sequential"
    elif not o.shuffle and order != "sequential" and fast and not sharded:
        logger.info("order=%r with shuffle=%r: using the requested order", order, o.shuffle)
    fingerprint = contracts.fingerprint_of(dataset)
    if o.cache is not None and fingerprint is None:
        raise ValueError("cache= needs a dataset with a .fingerprint (stallfree.open_dataset provides one)")
    world = o.world or o.job_world
    seed = _seed(o, fast, world)
    device = _device(o)
    staging = staging_for(dataset, o, order)
    # a short first window only where windows are fetched whole (the first batch waits for it)
    first_window = order_mod.ramp_of(o.window) if staging is not None and order == "block" else None
    return LoaderPlan(
        mode,
        order,
        placement,
        ordered,
        seed=seed,
        world=world,
        device=device,
        source=_index_source(dataset, o, mode, order, 0 if seed is None else seed, world, first_window),
        worker=_worker_plan(dataset, o, placement, fingerprint, staging),
        main=_main_plan(o, placement, device),
    )


def staging_for(dataset: Any, o: LoaderOptions, order: str) -> Staging | None:
    """Whether (and where) the workers stage whole shards: by default for block order over a
    remote sharded dataset (a window's shards are read whole, once per node, instead of one
    ranged GET per sample), when asked (``staging=`` a directory or a ``Staging``) for any
    order over one; never with ``staging=False``, in-process reads or a cache (hits need no shard)."""
    if o.staging is False or o.num_workers == 0 or o.cache is not None:
        return None
    if not (contracts.is_sharded(dataset) and isinstance(dataset, contracts.ConcurrentShardSource)):
        return None
    try:
        if not contracts.is_remote(dataset):
            return None
    except Exception:  # noqa: BLE001 - an unreachable store: the reads report it
        return None
    if isinstance(o.staging, Staging):
        return o.staging
    if isinstance(o.staging, str):
        return Staging(root=o.staging)
    return Staging() if (order == "block" or o.staging is True) else None


def _seed(o: LoaderOptions, fast: bool, world: World) -> int | None:
    if not fast or o.seed is not None:
        return int(o.seed or 0)
    return (
        0 if world.size > 1 else None
    )  # every rank must agree without talking: DistributedSampler's default


def _device(o: LoaderOptions) -> torch.device | None:
    if o.device is None:
        return None
    dev = torch.device(o.device)
    if dev.type == "cuda" and not o.cuda:
        logger.warning("device=%s requested but CUDA is not available; batches stay on the CPU", dev)
        return None
    return dev


def _index_source(
    dataset: Any,
    o: LoaderOptions,
    mode: str,
    order: str,
    seed: int,
    world: World,
    first_window: int | None = None,
) -> IndexSource:
    """Where the loader's indices come from (its mode's one difference), with its resume state."""
    if mode == "iterable":
        return StreamIndices()
    if mode == "sampler":
        return SamplerIndices(o.index_sampler, o.sampler, o.generator, o.auto_collation)
    return OrderIndices(
        dataset=dataset,
        order=order,
        seed=seed,
        world=world,
        uneven=o.uneven,
        window=o.window,
        batch_size=int(o.batch_size or 1),
        drop_last=o.drop_last,
        first_window=first_window,
    )


def _worker_plan(
    dataset: Any,
    o: LoaderOptions,
    placement: DecodePlacement,
    fingerprint: str | None,
    staging: Staging | None = None,
) -> WorkerPlan:
    if o.decode_threads is not None:
        threads = o.decode_threads
    else:  # the cores left per worker, for a per-sample decode of ours to spread over
        threads = o.worker_cores if placement.where == "sample" else 1
    return WorkerPlan(
        dataset=dataset,
        num_workers=o.num_workers,
        collate_fn=o.collate_fn,
        auto_collation=o.auto_collation,
        map_fn=placement.map_fn,
        batch_decode=placement.in_workers,
        send_raw=placement.send_raw,
        cache=o.cache,
        cache_stage=placement.cache_stage if o.cache is not None else None,
        fingerprint=fingerprint,
        on_error=o.on_error,
        worker_init_fn=o.worker_init_fn,
        max_slots=(o.prefetch_factor or 2) + 1,
        threads=threads,
        fetch_threads=o.fetch_threads,
        staging=staging,
        in_process=o.num_workers == 0,
    )


def _main_plan(o: LoaderOptions, placement: DecodePlacement, device: torch.device | None) -> MainPlan:
    pf = o.prefetch_factor or 2
    return MainPlan(
        depth=max(1, pf) * max(1, o.num_workers),  # like torch: prefetch_factor x workers in flight
        prefetch_factor=pf,
        in_order=o.in_order,
        pin_memory=o.pin_memory and o.cuda,
        device=device,
        decode_batch=placement.in_main,
        worker_decode=placement.where == "workers",
        finish=placement.finish,
        on_error=o.on_error,
        budget=None,  # per epoch: failure_budget(max_failures, the epoch's samples)
        timeout=o.timeout or 0,
        worker_timeout=o.worker_timeout,
    )

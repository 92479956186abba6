"""The loader's arguments as one frozen, self-validating value, and the planner: a pure function
from (dataset, options) to what the loader will do.

Before, ``DataLoader.__init__`` was the planner: 125 lines, 33 arguments, 23 mode branches, and
``state_dict`` branched on the mode again. Now ``__init__`` lets torch validate torch's
arguments, builds a :class:`LoaderOptions` (which validates ours, and the facts of torch's the
plan depends on), and calls :func:`plan`, which decides the mode, the epoch order and where
``decode=`` runs, and refuses combinations that cannot work. The index source
(``sources.py``) built from the plan carries the resume state, so saving and restoring it has no
mode branch either. Table tests: tests/loader/test_options.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from stallfree.loader import contracts
from stallfree.loader import order as order_mod
from stallfree.loader.contracts import DecodePlacement
from stallfree.loader.prefetch import check_max_failures
from stallfree.loader.world import World

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
        if self.iterable and (self.cache is not None or self.decode is not None):
            raise ValueError("cache= and decode= need a map-style dataset (one with __getitem__ and __len__)")

    @property
    def ours(self) -> bool:
        """One of our own options that only our order serves was given."""
        return any(x is not None for x in (self.seed, self.cache, self.decode, self.world, self.device))


@dataclass(frozen=True)
class LoaderPlan:
    """What a loader does, decided once at construction (see :func:`plan`)."""

    mode: str  # fast (our order and rank split) | sampler (a sampler through our workers) | iterable
    order: str  # the epoch order in fast mode (order.py); "sequential" otherwise
    decode: DecodePlacement
    ordered: bool  # the dataset orders itself (a mixture): read in sequence, epoch set in workers

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def fast(self) -> bool:
        return self.mode == "fast"


def plan(dataset: Any, options: LoaderOptions) -> LoaderPlan:
    """The mode, order and decode placement for ``dataset`` under ``options``; raises ValueError
    for combinations that cannot work.

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
    return LoaderPlan(mode, order, placement, ordered)

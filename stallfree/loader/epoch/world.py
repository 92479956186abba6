"""Who am I in the job: rank, world size, local rank, node, and which worker of the rank.

Plain arithmetic so it is testable without processes. The only place that looks at the
environment is :func:`world_from_env`, an explicit edge function the CLI (or a user script) calls;
library code otherwise takes a :class:`World` as an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """One process's place in a (possibly distributed) job."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"world size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside world of size {self.size}")
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"local rank {self.local_rank} outside local size {self.local_size}")
        if self.size % self.local_size:
            raise ValueError(f"world size {self.size} is not a multiple of local size {self.local_size}")

    @property
    def node(self) -> int:
        """Index of this process's machine (ranks are laid out node by node, as torchrun does)."""
        return self.rank // self.local_size

    @property
    def num_nodes(self) -> int:
        return self.size // self.local_size

    def as_dict(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "size": self.size,
            "local_rank": self.local_rank,
            "local_size": self.local_size,
            "node": self.node,
        }


def world_from_torch(local_size: int | None = None) -> World | None:
    """The world of an initialised ``torch.distributed`` process group, else None.

    torch.distributed does not know how ranks map onto machines; pass ``local_size`` (ranks per
    node) when node-level layout matters, otherwise the whole job counts as one node.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, size = dist.get_rank(), dist.get_world_size()
    local = local_size if local_size and size % local_size == 0 else size
    return World(rank=rank, size=size, local_rank=rank % local, local_size=local)


def world_from_env(env: Mapping[str, str]) -> World | None:
    """The world torchrun describes in ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
    of ``env`` (the CLI passes ``os.environ``: environment variables are read at the CLI edge only);
    None when those are absent."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    size = int(env["WORLD_SIZE"])
    rank = int(env["RANK"])
    local_size = int(env.get("LOCAL_WORLD_SIZE", size))
    local_rank = int(env.get("LOCAL_RANK", rank % local_size))
    return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size)


def resolve_world(world: World | Mapping[str, int] | tuple[int, int] | None = None) -> World:
    """An explicit ``world`` wins; else an initialised torch.distributed group; else one process.

    ``world`` may be a :class:`World`, a mapping with World's fields, or ``(rank, size)``.
    """
    if isinstance(world, World):
        return world
    if isinstance(world, Mapping):
        return World(**{k: int(v) for k, v in world.items() if k != "node"})
    if isinstance(world, tuple):
        if len(world) != 2:
            raise ValueError(f"world tuple must be (rank, size), got {world!r}")
        return World(
            rank=int(world[0]), size=int(world[1]), local_rank=int(world[0]), local_size=int(world[1])
        )
    if world is not None:
        raise TypeError(f"world must be a World, mapping or (rank, size) tuple, got {type(world).__name__}")
    return world_from_torch() or World()


def split_for_worker(n_items: int, worker_id: int, num_workers: int) -> range:
    """Item positions worker ``worker_id`` handles when a rank's ``n_items`` are dealt round-robin."""
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"worker {worker_id} outside {num_workers} workers")
    return range(worker_id, n_items, num_workers)

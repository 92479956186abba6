"""Admission/eviction policies, shared by every tier.

``minio`` admits until the tier is full and then never evicts. Under epoch-random access every
sample is read once per epoch in a fresh order, so any cached sample is as good as any other:
keeping a fixed subset hits exactly the cached fraction, while LRU keeps throwing out samples just
before they are needed again (CoorDL, Mohan et al., VLDB 2021). ``lru`` evicts the least recently
used entries to make room, which suits skewed (non-epoch) access.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """What a tier does when an entry does not fit."""

    name: str
    evicts: bool  # make room by evicting least recently used entries
    redis_maxmemory_policy: str  # the equivalent Redis server setting

    def room_needed(self, used: int, size: int, capacity: int | None) -> int:
        """Bytes to evict before an entry of ``size`` bytes is stored (0: none, or never evicts;
        an entry larger than the whole capacity evicts nothing and is then not admitted)."""
        if not self.evicts or capacity is None or size > capacity:
            return 0
        return max(0, used + size - capacity)

    def admits(self, used: int, size: int, capacity: int | None) -> bool:
        """Whether an entry of ``size`` bytes may be stored now (after any eviction LRU does)."""
        if capacity is None:
            return True
        if self.evicts:
            return size <= capacity
        return used + size <= capacity


MINIO = Policy("minio", evicts=False, redis_maxmemory_policy="noeviction")
LRU = Policy("lru", evicts=True, redis_maxmemory_policy="allkeys-lru")
POLICIES = {p.name: p for p in (MINIO, LRU)}


def get_policy(policy: str | Policy) -> Policy:
    """Resolve a policy name (``minio`` or ``lru``); a clear ``ValueError`` for anything else."""
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[str(policy).lower()]
    except KeyError:
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {sorted(POLICIES)}") from None

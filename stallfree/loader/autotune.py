"""Online prefetch-depth tuning (``autotune=True``): deepen the queue while the consumer waits,
shallow it while batches sit unused, never past a memory budget.

Pure decision logic fed with what ``__next__`` already measures, so it is tested without processes.
"""

from __future__ import annotations


class DepthTuner:
    """Decides the number of batches in flight from queue occupancy and consumer waits.

    Every ``window`` batches: if the consumer found the queue empty and waited in more than
    ``wait_share`` of them, the depth grows by a quarter (at least one); if it never waited and
    the queue never fell below two ready batches, the depth shrinks by one. The depth stays within
    ``[min_depth, max_depth]`` and within ``memory_budget`` bytes of batches.
    """

    def __init__(
        self,
        depth: int,
        *,
        min_depth: int = 1,
        max_depth: int = 64,
        memory_budget: int = 1 << 30,
        window: int = 8,
        wait_share: float = 0.1,
        wait_threshold_s: float = 0.001,
    ) -> None:
        if not 1 <= min_depth <= max_depth:
            raise ValueError(f"need 1 <= min_depth <= max_depth, got {min_depth}, {max_depth}")
        self.min_depth, self.max_depth = min_depth, max_depth
        self.memory_budget = memory_budget
        self.window = window
        self.wait_share = wait_share
        self.wait_threshold_s = wait_threshold_s
        self.batch_bytes = 0
        self.depth = self._clamp(depth)
        self._waits = 0
        self._seen = 0
        self._min_occupancy: int | None = None
        self.history: list[tuple[int, int]] = []  # (batch number, new depth)
        self._batches = 0

    def _cap(self) -> int:
        by_memory = self.memory_budget // self.batch_bytes if self.batch_bytes else self.max_depth
        return max(self.min_depth, min(self.max_depth, by_memory))

    def _clamp(self, depth: int) -> int:
        return max(self.min_depth, min(self._cap(), depth))

    def saw_batch_bytes(self, nbytes: int) -> None:
        self.batch_bytes = max(self.batch_bytes, int(nbytes))

    def observe(self, occupancy: int, wait_s: float) -> int:
        """Record one ``__next__``; returns the change of depth to apply now (usually 0)."""
        self._batches += 1
        self._seen += 1
        if occupancy == 0 and wait_s > self.wait_threshold_s:
            self._waits += 1
        self._min_occupancy = (
            occupancy if self._min_occupancy is None else min(self._min_occupancy, occupancy)
        )
        if self._seen < self.window:
            return 0
        new = self.depth
        if self._waits > self.wait_share * self._seen:
            new = self.depth + max(1, self.depth // 4)
        elif self._waits == 0 and (self._min_occupancy or 0) >= 2:
            new = self.depth - 1
        new = self._clamp(new)
        self._waits, self._seen, self._min_occupancy = 0, 0, None
        delta, self.depth = new - self.depth, new
        if delta:
            self.history.append((self._batches, new))
        return delta

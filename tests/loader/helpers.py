"""Small map-style datasets for the loader tests (module-level so spawn/fork workers can pickle them)."""

from __future__ import annotations

import os
import time
import weakref

import torch
import torch.utils.data as tud


class Numbers(tud.Dataset):
    """Sample i is {"i": i, "x": a small tensor filled with i}."""

    def __init__(self, n: int, width: int = 4) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"i": i, "x": torch.full((self.width,), float(i))}


class Sharded(Numbers):
    """16 samples in two shards of 8, as a sharded source offers them (fingerprint, sizes,
    get_many): what the planner tests feed it to choose the sharded paths."""

    fingerprint = "f" * 16
    shard_sizes = [8, 8]

    def __init__(self) -> None:
        super().__init__(16)

    def get_many(self, indices):
        return [self[i] for i in indices]


class Failing(Numbers):
    """Raises ValueError for the indices in ``bad``."""

    def __init__(self, n: int, bad: set[int]) -> None:
        super().__init__(n)
        self.bad = set(bad)

    def __getitem__(self, i: int) -> dict:
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return {"__key__": f"k{i:04d}", **super().__getitem__(i)}


class Dies(Numbers):
    """The worker process exits abruptly on index ``at``."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    def __getitem__(self, i: int) -> dict:
        if i == self.at and tud.get_worker_info() is not None:
            os._exit(7)
        return super().__getitem__(i)


class Hangs(Numbers):
    """Sleeps (far longer than the tests wait) on index ``at``."""

    def __init__(self, n: int, at: int, seconds: float = 60.0) -> None:
        super().__init__(n)
        self.at, self.seconds = at, seconds

    def __getitem__(self, i: int) -> dict:
        if i == self.at:
            time.sleep(self.seconds)
        return super().__getitem__(i)


class WhoAmI(Numbers):
    """Each sample records the worker id that produced it (-1 in the main process)."""

    def __getitem__(self, i: int) -> dict:
        info = torch.utils.data.get_worker_info()
        return {
            "i": i,
            "worker": -1 if info is None else info.id,
            "nworkers": 0 if info is None else info.num_workers,
        }


class Big(Numbers):
    """Samples of ``nbytes`` bytes each, to watch memory."""

    def __init__(self, n: int, nbytes: int) -> None:
        super().__init__(n)
        self.nbytes = nbytes

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "x": torch.full((self.nbytes // 4,), float(i))}


def indices(loader) -> list[int]:
    return [i for b in loader for i in b["i"].tolist()]


def rss_shmem() -> int:
    """Shared-memory pages this process has mapped right now (bytes, /proc/self/status RssShmem)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


class WorkerProbe(Big):
    """Sample i also says, from inside the worker, which process served it and how many shared
    pages that process had mapped when it started on the sample."""

    def __init__(self, n: int, nbytes: int = 64) -> None:
        super().__init__(n, nbytes)

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "shm_mapped": rss_shmem(), "pid": os.getpid()}


def segfault_on_3(sample: dict) -> dict:
    """A decode that crashes the process in native code at sample 3 (a broken C decoder)."""
    if sample["i"] == 3:
        import ctypes

        ctypes.string_at(0)
    return sample


class FinaliserProbe:
    """Cyclic garbage whose finaliser records the pid it runs in (on a pipe)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.me = self  # a cycle: only the collector frees it

    def __del__(self) -> None:
        os.write(self.fd, f"{os.getpid()}\n".encode())


def collect_garbage(worker_id: int) -> None:
    import gc

    gc.collect()


_LIVE: weakref.WeakSet = weakref.WeakSet()


class LiveSamples(Numbers):
    """Each sample says how many earlier samples' tensors were still alive in its worker."""

    def __getitem__(self, i: int) -> dict:
        alive = len(_LIVE)
        sample = super().__getitem__(i)
        _LIVE.add(sample["x"])
        return {**sample, "alive": alive}

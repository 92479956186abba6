"""Reuse batch output buffers once the consumer has let go of them.

A 64 x 3 x 224 x 224 float32 batch is 38 MB: too big for malloc's heap, so every fresh batch is
new pages from the kernel, and touching them costs about 0.2 ms of CPU per image (measured: 0.24
ms fresh vs 0.02 ms reused) — an eighth of decoding itself. The pool hands out numpy arrays
wrapped by ``torch.from_numpy``: the tensor's storage holds a reference to its array, so when the
array's reference count is back to the pool's own, no tensor or view of it is alive anywhere and
the memory can be written again.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.uint8: np.uint8}


class BufferPool:
    """Up to ``keep`` arrays per (shape, dtype); a new one is allocated when all are in use."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = max(0, keep)
        self._arrays: dict[tuple, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def __getstate__(self) -> dict:
        return {"keep": self.keep}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["keep"])

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape``/``dtype`` on the CPU, from a free buffer when one exists."""
        key = (shape, dtype)
        with self._lock:
            arrays = self._arrays.setdefault(key, [])
            for arr in arrays:
                # Referenced by the list, the loop variable and getrefcount's argument: nobody else.
                if sys.getrefcount(arr) <= 3:
                    self.reused += 1
                    return torch.from_numpy(arr)
            arr = np.empty(shape, _NP[dtype])
            self.allocated += 1
            if len(arrays) < self.keep:
                arrays.append(arr)
            return torch.from_numpy(arr)

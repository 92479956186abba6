"""Output buffers are reused only when no tensor or view of the previous batch is alive."""

from __future__ import annotations

import torch

from stallfree.gpu_decode.buffers import BufferPool
from stallfree.gpu_decode.select import ImageDecode

from .conftest import samples_from


def test_pool_reuses_only_released_buffers():
    pool = BufferPool(keep=2)
    a = pool.tensor((2, 3), torch.float32)
    ptr_a = a.data_ptr()
    b = pool.tensor((2, 3), torch.float32)
    assert b.data_ptr() != ptr_a
    view = a[1]
    del a
    c = pool.tensor((2, 3), torch.float32)
    assert c.data_ptr() not in (ptr_a, b.data_ptr())  # a view still holds a's memory
    del view
    assert pool.tensor((2, 3), torch.float32).data_ptr() == ptr_a
    assert pool.tensor((3, 3), torch.float16).dtype == torch.float16
    assert (pool.reused, pool.allocated) == (1, 4)


def test_pool_with_keep_zero_never_reuses():
    pool = BufferPool(keep=0)
    pool.tensor((4,), torch.float32)
    pool.tensor((4,), torch.float32)
    assert (pool.reused, pool.allocated) == (0, 2)


def test_held_batches_are_never_overwritten(rgb_jpegs):
    for backend in ("cpu", "dali"):
        dec = ImageDecode(train=True, size=32, backend=backend, reuse_buffers=1)
        samples = samples_from(rgb_jpegs)
        first = dec.decode_batch(samples, seed=1)["image"]
        snapshot = first.clone()
        dec.decode_batch(samples, seed=2)
        dec.decode_batch(samples, seed=3)
        assert torch.equal(first, snapshot), backend
        del first
        dec.decode_batch(samples, seed=4)
        st = dec.stats()
        assert st["buffers_reused"] >= 1, backend

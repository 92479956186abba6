"""``bytes`` leaves of a batch travel in the shared-memory slot (``shm.BytesRef``), not pickled
through the result pipe: raw samples (encoded images, text) arrive byte-equal, as ``bytes``."""

import os

import torch

from stallfree import DataLoader
from stallfree.loader.shm import storage as shm


class RawSamples(torch.utils.data.Dataset):
    """Big and small bytes, a bytearray and a str per sample."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        big = bytes([i % 251]) * (5000 + 97 * i)
        return {"big": big, "small": bytes([i]) * 10, "ba": bytearray(big[:2000]), "key": f"k{i}"}


def _raw(samples: list) -> dict:
    return {k: [s[k] for s in samples] for k in samples[0]}


def test_a_big_bytes_leaf_is_written_into_the_slot_and_read_back_equal():
    storage = torch.UntypedStorage(1 << 20)
    big, small = os.urandom(50_000), b"tiny"
    batch = {"jpg": [big, big[:3000]], "key": ["a", "b"], "small": [small], "ba": [bytearray(big[:5000])]}
    desc, needed = shm.describe(batch, shm.Arena(storage))
    assert needed >= 53_000 and isinstance(desc["jpg"][0], shm.BytesRef)
    assert desc["small"] == [small] and desc["key"] == ["a", "b"]  # small ones stay as they are
    assert isinstance(desc["ba"][0], bytearray)  # only exact bytes go in: the type is kept
    assert shm.described_bytes(desc) == 53_000
    released = []
    out = shm.materialise(desc, storage, release=lambda: released.append(1))
    assert out == batch and type(out["jpg"][0]) is bytes and released == [1]


def test_too_small_a_slot_asks_for_room_for_the_bytes():
    desc, needed = shm.describe({"jpg": [os.urandom(9000)]}, shm.Arena(torch.UntypedStorage(4096)))
    assert desc is None and needed >= 9000


def test_batches_of_raw_bytes_from_workers_equal_the_in_process_ones():
    ds = RawSamples()
    want = list(DataLoader(ds, batch_size=8, num_workers=0, collate_fn=_raw))
    for workers in (1, 2):
        got = list(DataLoader(ds, batch_size=8, num_workers=workers, collate_fn=_raw))
        assert got == want
        assert all(type(b) is bytes for batch in got for b in batch["big"])

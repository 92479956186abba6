"""Slot segments by descriptor over a worker's socket pair (loader/shm/segments.py): the storage the
main process maps is the worker's own memory, matched by serial however the batches arrive,
and a segment that never arrives is an error naming the worker, never a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct

import pytest
import torch

from stallfree import DataLoader
from stallfree.loader import _torch_compat as compat
from stallfree.loader.shm.segments import SegmentError, SegmentReceiver, SegmentSender, socket_pair
from tests.loader.helpers import Numbers


def _storage(fill: int, nbytes: int = 1 << 16) -> torch.UntypedStorage:
    storage = compat.new_shared_storage(nbytes)
    torch.tensor([], dtype=torch.uint8).set_(storage).fill_(fill)
    return storage


def _bytes(storage: torch.UntypedStorage) -> bytes:
    return bytes(torch.tensor([], dtype=torch.uint8).set_(storage).tolist())


def test_segments_arrive_by_serial_in_any_order_and_share_the_memory():
    mine, theirs = socket_pair()
    sender, receiver = SegmentSender(theirs), SegmentReceiver(mine, worker=3)
    storages = [_storage(k) for k in range(3)]
    sent = [sender.send(s) for s in storages]
    assert [s.serial for s in sent] == [1, 2, 3] and {s.nbytes for s in sent} == {1 << 16}
    got = {s.serial: receiver.receive(s) for s in (sent[2], sent[0], sent[1])}  # out of order
    for k, s in enumerate(sent):
        assert _bytes(got[s.serial]) == bytes([k]) * (1 << 16)
    torch.tensor([], dtype=torch.uint8).set_(storages[1])[:4] = 7  # the worker writes ...
    assert _bytes(got[2])[:5] == bytes([7, 7, 7, 7, 1])  # ... and the main process sees it
    receiver.close()
    sender.close()


def test_a_discarded_segment_does_not_shift_the_next_one():
    mine, theirs = socket_pair()
    sender, receiver = SegmentSender(theirs), SegmentReceiver(mine, worker=0)
    stale, fresh = sender.send(_storage(1)), sender.send(_storage(2))
    receiver.discard(stale)
    assert _bytes(receiver.receive(fresh))[:1] == b"\x02"
    receiver.close()


def test_a_segment_that_never_arrives_names_the_worker():
    mine, theirs = socket_pair()
    sender, receiver = SegmentSender(theirs), SegmentReceiver(mine, worker=5)
    seg = sender.send(_storage(1))
    receiver.receive(seg)
    sender.close()  # the worker is gone, and with it the next descriptor
    with pytest.raises(SegmentError, match="worker 5's segment socket closed before segment 2"):
        receiver.receive(type(seg)(2, seg.nbytes))


def test_a_segment_whose_size_disagrees_with_its_batch_is_an_error_not_a_mapping():
    mine, theirs = socket_pair()
    sender, receiver = SegmentSender(theirs), SegmentReceiver(mine, worker=2)
    seg = sender.send(_storage(1, 1 << 16))
    with pytest.raises(SegmentError, match="segment 1 was sent as 65536 bytes, the batch announced 131072"):
        receiver.receive(type(seg)(seg.serial, 2 << 16))
    with os.fdopen(os.memfd_create("short"), "wb") as short:  # a file shorter than it is said to be
        short.truncate(4096)
        socket.send_fds(theirs, [struct.pack("<qq", 2, 1 << 16)], [short.fileno()])
    with pytest.raises(SegmentError, match="segment 2 holds 4096 bytes, the batch announced 65536"):
        receiver.receive(type(seg)(2, 1 << 16))
    receiver.close()


def test_a_broken_socket_sends_the_storage_itself():
    mine, theirs = socket_pair()
    mine.close()
    assert SegmentSender(theirs).send(_storage(1)) is None  # BatchReady keeps the storage


# spawn: two fresh interpreters importing torch, so marked slow (started first)
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_loader_batches_come_in_descriptor_segments_and_equal_the_dataset(method, monkeypatch):
    received = []
    real = SegmentReceiver.receive

    def counting(self, segment):
        received.append(segment.serial)
        return real(self, segment)

    monkeypatch.setattr(SegmentReceiver, "receive", counting)
    ds = Numbers(64, width=8)
    dl = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=mp.get_context(method))
    batches = [b for _ in range(2) for b in dl]
    assert [b["i"].tolist() for b in batches] == [list(range(k, k + 8)) for k in range(0, 64, 8)] * 2
    assert all(torch.equal(b["x"], b["i"][:, None].float().expand(8, 8)) for b in batches)
    assert received and len(received) <= 2 * 8  # each worker's new slots, never one per batch

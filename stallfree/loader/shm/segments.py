"""A worker's new slot segments reach the main process by descriptor, over a socket pair made
when the pool starts.

Why: a new slot's storage used to travel pickled inside its ``BatchReady``, by torch's storage
reduction: the worker's multiprocessing resource sharer starts a listener thread, and the main
process connects to it and runs an HMAC handshake for each descriptor. That cost 11-36 ms for
a worker's first segment, on the path of every pool's first batch (measured: RESULTS.md, Object
storage and Start-up). Here the worker writes the descriptor on its end of a ``SOCK_SEQPACKET``
pair (``SCM_RIGHTS``) before it queues the batch, and the main process reads it when it adopts
the batch: one ``sendmsg`` and one ``recvmsg``. Where that route is missing (no descriptor to
send), the storage travels pickled, as before.

Each segment carries a serial number, so a batch the main process never adopts (left over from
an earlier iterator) cannot hand its descriptor to the next one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch

from stallfree.loader import _torch_compat as compat
from stallfree.loader import fdlimit

_HEADER = struct.Struct("<qq")  # serial, bytes
RECEIVE_TIMEOUT_S = 60.0  # the descriptor is written before its batch is queued: it is there already


class SegmentError(RuntimeError):
    """A segment announced by a batch did not arrive (its worker's socket closed or broke)."""


@dataclass(frozen=True)
class SentSegment:
    """In a ``BatchReady`` in place of the storage: its descriptor went over the worker's socket."""

    serial: int
    nbytes: int


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(main process's end, worker's end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class SegmentSender:
    """The worker's end: ``send(storage)`` writes the storage's descriptor, returns what the
    batch carries instead (None: send the storage itself)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._serial = 0

    def send(self, storage: torch.UntypedStorage) -> SentSegment | None:
        shared = compat.shared_fd(storage)
        if shared is None:
            return None
        fd, nbytes = shared
        self._serial += 1
        try:
            socket.send_fds(self._sock, [_HEADER.pack(self._serial, nbytes)], [fd])
        except OSError:
            return None  # the main process reads the pickled storage instead
        return SentSegment(self._serial, nbytes)

    def close(self) -> None:
        self._sock.close()


class SegmentReceiver:
    """The main process's end for one worker: ``receive(segment)`` -> the shared storage."""

    def __init__(self, sock: socket.socket, worker: int) -> None:
        sock.settimeout(RECEIVE_TIMEOUT_S)
        self._sock = sock
        self._worker = worker
        self._early: dict[int, int] = {}  # serial -> descriptor, read while looking for another

    def receive(self, segment: SentSegment) -> torch.UntypedStorage:
        fd = self._take(segment)
        try:
            size = os.fstat(fd).st_size
            if size < segment.nbytes:  # a storage over bytes the file lacks would fault on access
                raise SegmentError(
                    f"worker {self._worker}'s shared-memory segment {segment.serial} holds {size} "
                    f"bytes, the batch announced {segment.nbytes}"
                )
            try:
                return compat.shared_storage_of_fd(fd, segment.nbytes)
            except RuntimeError as exc:  # torch's "could not duplicate ...": say why, if that is why
                if fdlimit.out_of_descriptors():
                    raise fdlimit.too_many_open_files(
                        f"mapping worker {self._worker}'s batch segment"
                    ) from exc
                raise
        finally:
            os.close(fd)

    def discard(self, segment: Any) -> None:
        """A batch that will not be adopted: close its descriptor (nothing is mapped)."""
        if isinstance(segment, SentSegment):
            with contextlib.suppress(SegmentError):
                os.close(self._take(segment))

    def _take(self, segment: SentSegment) -> int:
        """The descriptor sent for ``segment`` (the caller closes it); those read on the way,
        for later serials, are kept for their own batches."""
        fd = self._early.pop(segment.serial, None)
        while fd is None:
            try:
                data, fds, flags, _ = socket.recv_fds(self._sock, _HEADER.size, 1)
            except OSError as exc:
                if fdlimit.is_emfile(exc):
                    raise fdlimit.too_many_open_files(
                        f"receiving worker {self._worker}'s batch segment"
                    ) from exc
                raise SegmentError(
                    f"worker {self._worker}'s shared-memory segment {segment.serial} did not arrive: {exc}"
                ) from exc
            except TimeoutError as exc:
                raise SegmentError(
                    f"worker {self._worker}'s shared-memory segment {segment.serial} did not arrive: {exc}"
                ) from exc
            if flags & socket.MSG_CTRUNC and not fds:
                # the kernel dropped the descriptor: no room for it in this process's table
                raise fdlimit.too_many_open_files(f"receiving worker {self._worker}'s batch segment")
            if len(data) != _HEADER.size or len(fds) != 1:
                for extra in fds:
                    os.close(extra)
                raise SegmentError(
                    f"worker {self._worker}'s segment socket closed before segment {segment.serial} "
                    "(the worker died?)"
                )
            serial, nbytes = _HEADER.unpack(data)
            if serial == segment.serial and nbytes != segment.nbytes:
                os.close(fds[0])
                raise SegmentError(
                    f"worker {self._worker}'s segment {serial} was sent as {nbytes} bytes, the batch "
                    f"announced {segment.nbytes}"
                )
            if serial == segment.serial:
                fd = fds[0]
            else:
                self._early[serial] = fds[0]
        return fd

    def close(self) -> None:
        for fd in self._early.values():
            os.close(fd)
        self._early.clear()
        self._sock.close()


__all__ = ["SegmentError", "SegmentReceiver", "SegmentSender", "SentSegment", "socket_pair"]

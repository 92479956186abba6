"""Slots coming back from the main process to the worker that owns them, without ever blocking.

A slot is handed back when the consumer drops the last tensor of its batch: from a tensor's
finaliser, on whatever thread drops it, possibly during interpreter shutdown, possibly after the
iterator and its workers are gone. A ``multiprocessing.Queue.put`` there starts a feeder thread
and can wait forever (observed: a training loop that raised while holding a batch never exited).
So the channel is a pipe whose sending end is non-blocking: a slot number is one 8-byte write
(atomic below PIPE_BUF), and a full pipe, a gone worker or a closed channel make ``send`` a
no-op that returns False (the worker then makes a new slot; nothing waits).
"""

from __future__ import annotations

import os
import queue
import struct
from typing import Any

_SLOT = struct.Struct("<q")


class SlotReturns:
    """main -> one worker: numbers of slots whose batches the consumer has dropped."""

    def __init__(self, ctx: Any = None) -> None:
        """``ctx``: a multiprocessing context (worker processes), or None (an in-process worker)."""
        self.closed = False
        self._pack = _SLOT.pack  # bound now: module globals may be gone when a finaliser sends
        self._local: queue.SimpleQueue | None = None
        self._recv = self._send = None
        if ctx is None:
            self._local = queue.SimpleQueue()
        else:
            self._recv, self._send = ctx.Pipe(duplex=False)
            os.set_blocking(self._send.fileno(), False)

    def send(self, slot: int) -> bool:
        """Hand ``slot`` back; never blocks, never raises (False: not delivered)."""
        if self.closed:
            return False
        try:
            if self._local is not None:
                self._local.put(slot)
            else:
                self._send.send_bytes(self._pack(slot))
            return True
        except Exception:  # noqa: BLE001 - full pipe, gone worker, interpreter shutdown: drop it
            return False

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned worker gets: the receiving end only (it never sends)."""
        state = dict(self.__dict__)
        state.update(_pack=None, _send=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pack = _SLOT.pack

    def close(self) -> None:
        """From now on ``send`` is a no-op (the pool is shutting down)."""
        self.closed = True

    # -- worker side --------------------------------------------------------------------------
    def take_ready(self) -> list[int]:
        """Every slot returned so far, without waiting."""
        out: list[int] = []
        try:
            if self._local is not None:
                while True:
                    out.append(self._local.get_nowait())
            while self._recv.poll(0):
                out.append(_SLOT.unpack(self._recv.recv_bytes())[0])
        except (queue.Empty, EOFError, OSError):
            pass
        return out

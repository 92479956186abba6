"""The delivery record (``DataLoader(record_keys=DIR)``): per rank, a compact binary log of the
batches each step handed to the consumer, so ``stallfree audit DIR`` can prove every sample of
each epoch was delivered exactly once across ranks, resumes, world sizes and skips.

What a batch held is not written out: its epoch positions are arithmetic on the ``BEGIN``
record's numbers (start, rank, world size, batch size, tail rule, skipped ranges: the
``RankShare`` the loader dispatched from), so a batch costs one 25-byte record, a few
microseconds, and the audit checks what matters across runs: which batches of which run were
delivered, and that together they cover each epoch exactly once.

One file per loader per process (``rank00003-<ns>-<pid>.sfkeys``) on an ``O_APPEND``
descriptor. Batch records wait in a small buffer (64 KiB, some 2,600 batches) and are written
whenever the loader's state is saved (``state_dict``), an epoch begins or ends, the buffer
fills, or the loader closes: a killed run's file then holds every batch up to its last saved
state, and what it loses after that is what a resume from that state rolls back anyway (a
write per batch cost 3-5 us, about 1% of a loader of ints). A record cut short by a kill is
reported and left out by the reader. No pickle: little-endian fixed-size ``struct`` records.

Records (after the 8-byte magic):

- ``BEGIN``: a loader starts an epoch: rank, world size, epoch, start position, step, the
  epoch's length, batch size, tail rule, wall time (orders the runs of a directory);
- ``SKIP``: a position range of that epoch the run leaves out (``skip_steps=``);
- ``BATCH``: step, epoch and how many positions the consumer received in that step's batch;
- ``END``: this rank received its whole share of the epoch.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stallfree.errors import CorruptShardError
from stallfree.loader.epoch.order import RankShare
from stallfree.loader.epoch.progress import EpochProgress

MAGIC = b"SFKEYS\x00\x01"
SUFFIX = ".sfkeys"
BEGIN, SKIP, BATCH, END = 1, 2, 3, 4
_BEGIN = struct.Struct(
    "<BIIqqqqqIBB"
)  # type, rank, world, epoch, start, step, n, time_ns, batch, pad, drop_last
_SKIP = struct.Struct("<Bqqq")  # type, epoch, lo, hi
_BATCH = struct.Struct("<BqqI")  # type, step, epoch, count
_END = struct.Struct("<Bqq")  # type, epoch, step
FLUSH_BYTES = 1 << 16  # batch records kept before a write (see the module docstring)


class RecordError(CorruptShardError, ValueError):
    """A delivery record file that does not parse: names the file and byte offset."""


@dataclass(frozen=True)
class Begin:
    rank: int
    world_size: int
    epoch: int
    start: int
    step: int
    n: int
    time_ns: int
    batch_size: int
    uneven: str
    drop_last: bool


@dataclass(frozen=True)
class SkipRange:
    epoch: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Batch:
    step: int
    epoch: int
    count: int  # positions in the batch


@dataclass(frozen=True)
class End:
    epoch: int
    step: int


Record = Begin | SkipRange | Batch | End


class RecordWriter:
    """Appends records for one rank to its own file under ``directory`` (made if missing)."""

    def __init__(self, directory: str | os.PathLike[str], rank: int) -> None:
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / f"rank{int(rank):05d}-{time.time_ns()}-{os.getpid()}{SUFFIX}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._pid = os.getpid()
        self._buffer = bytearray(MAGIC)
        self.flush()

    def begin(self, b: Begin, skipped: tuple[tuple[int, int], ...]) -> None:
        head = _BEGIN.pack(
            BEGIN,
            b.rank,
            b.world_size,
            b.epoch,
            b.start,
            b.step,
            b.n,
            b.time_ns,
            b.batch_size,
            b.uneven == "pad",
            b.drop_last,
        )
        self._buffer += head + b"".join(_SKIP.pack(SKIP, b.epoch, lo, hi) for lo, hi in skipped)
        self.flush()

    def batch(self, step: int, epoch: int, count: int) -> None:
        self._buffer += _BATCH.pack(BATCH, step, epoch, count)
        if len(self._buffer) >= FLUSH_BYTES:
            self.flush()

    def end(self, epoch: int, step: int) -> None:
        self._buffer += _END.pack(END, epoch, step)
        self.flush()

    def flush(self) -> None:
        """Write what waits (the loader calls it when its state is saved)."""
        if self._fd < 0 or self._pid != os.getpid():  # closed, or a forked child's copy
            self._buffer.clear()
            return
        view = memoryview(bytes(self._buffer))
        self._buffer.clear()
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            self.flush()
        fd, self._fd = self._fd, -1
        if fd >= 0 and self._pid == os.getpid():
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - a finaliser never raises
            pass


@dataclass(frozen=True)
class RecordFile:
    """One file read back: its records, and whether its last record was cut short."""

    path: Path
    records: tuple[Record, ...]
    truncated: bool


def read_records(path: str | os.PathLike[str]) -> RecordFile:
    """Every whole record of ``path``; a malformed one (not a cut-short tail) is a
    ``RecordError`` naming the file and byte offset."""
    p = Path(path)
    data = p.read_bytes()
    if data[: len(MAGIC)] != MAGIC:
        raise RecordError(f"not a stallfree delivery record (magic {data[:8]!r})", shard=str(p), offset=0)
    return RecordFile(p, tuple(_records(data, str(p), out := [False])), out[0])


def _records(data: bytes, name: str, truncated: list[bool]) -> Iterator[Record]:
    at = len(MAGIC)
    sizes = {BEGIN: _BEGIN, SKIP: _SKIP, BATCH: _BATCH, END: _END}
    while at < len(data):
        kind = data[at]
        head = sizes.get(kind)
        if head is None:
            raise RecordError(f"unknown record type {kind}", shard=name, offset=at)
        if at + head.size > len(data):
            truncated[0] = True
            return
        fields = head.unpack_from(data, at)
        if kind == BEGIN:
            _, rank, world, epoch, start, step, n, t, bs, pad, drop = fields
            yield Begin(rank, world, epoch, start, step, n, t, bs, "pad" if pad else "drop", bool(drop))
        elif kind == SKIP:
            yield SkipRange(*fields[1:])
        elif kind == END:
            yield End(*fields[1:])
        else:
            yield Batch(*fields[1:])
        at += head.size


def record_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The delivery record files in ``directory``, sorted by name."""
    return sorted(Path(directory).glob(f"*{SUFFIX}"))


class EpochRecorder:
    """Writes what one rank's epoch delivers: its BEGIN (with the skipped ranges) at once, a
    BATCH per batch received (step ``first_step + seq``), END when the share is all received."""

    def __init__(self, writer: RecordWriter, share: RankShare, batch_size: int, begin: Begin) -> None:
        self.writer, self.share, self.batch_size, self.first = writer, share, batch_size, begin
        writer.begin(begin, share.kept.skipped)
        self._ended = False

    def batch(self, seq: int, count: int) -> None:
        self.writer.batch(self.first.step + seq, self.first.epoch, count)

    def end(self, batches: int) -> None:
        if not self._ended:
            self._ended = True
            self.writer.end(self.first.epoch, self.first.step + batches)


@dataclass
class RecordedProgress(EpochProgress):
    """An epoch's progress that also records each batch the consumer receives (``EpochRecorder``)."""

    recorder: EpochRecorder | None = None
    batch_size: int = 1

    def on_batch(self, positions: int, seq: int | None = None) -> None:
        super().on_batch(positions, seq)
        if self.recorder is not None and seq is not None:
            self.recorder.batch(seq, positions)
            if self.done:
                self.recorder.end(-(-self.received // self.batch_size))

    def finish(self) -> None:
        super().finish()
        if self.recorder is not None:
            self.recorder.end(-(-self.received // self.batch_size))

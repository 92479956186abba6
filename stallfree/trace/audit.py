"""``stallfree audit DIR``: check a delivery record (``record_keys=DIR``) for every sample of each
epoch delivered exactly once across ranks, resumes, world-size changes and skips, and name the
first violation.

How the records are read (epoch/record.py writes them):

- A *run* is one start of reading: the ranks' ``BEGIN`` records with the same (epoch, start
  position, step, world size), the k-th such ``BEGIN`` of each rank forming the k-th run with
  that key (a resume from the same state twice is two runs). Runs are ordered by their
  earliest wall time.
- A run that starts at (epoch ``e``, position ``p``) rolls back whatever earlier runs delivered
  at or after (``e``, ``p``): a resume from a checkpoint repeats what the killed run delivered
  after it, and that is the point of a resume, not a duplicate.
- A batch's positions follow from its run's ``BEGIN`` (the share it was dispatched from) and
  its step.
- What is left must hold, per epoch of ``n`` positions, every position outside the skipped
  ranges exactly once (padded reads, repeats that even out the ranks, aside). An epoch no run
  finished (its last) is checked up to where it got: a position missing while one more than
  a global batch after it was delivered is lost.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stallfree.loader.epoch.order import Kept, RankShare, Sequential
from stallfree.loader.epoch.record import Batch, Begin, End, RecordFile, SkipRange, read_records, record_files


@dataclass(frozen=True)
class Violation:
    """The first thing wrong: ``kind`` is ``duplicate`` (delivered more than once: ``seen``
    names each delivery as (rank, step, file)), ``lost`` (never delivered) or ``skipped``
    (delivered although a resume's ``skip_steps`` left it out)."""

    kind: str
    epoch: int
    position: int
    seen: tuple[tuple[int, int, str], ...] = ()

    def __str__(self) -> str:
        if self.kind == "lost":
            return f"epoch {self.epoch} position {self.position}: never delivered (lost)"
        if self.kind == "skipped":
            where = "; ".join(f"rank {r} at step {s} ({f})" for r, s, f in self.seen)
            return f"epoch {self.epoch} position {self.position}: delivered although skipped: {where}"
        where = "; ".join(f"rank {r} at step {s} ({f})" for r, s, f in self.seen)
        return f"epoch {self.epoch} position {self.position}: delivered {len(self.seen)} times: {where}"


@dataclass(frozen=True)
class AuditReport:
    ok: bool
    files: int
    runs: int
    epochs: dict[int, dict[str, int]] = field(default_factory=dict)  # per epoch: n, delivered, skipped, ...
    first: Violation | None = None
    duplicates: int = 0
    lost: int = 0
    truncated: tuple[str, ...] = ()  # files whose last record was cut short (a killed run)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "files": self.files,
            "runs": self.runs,
            "epochs": {str(k): v for k, v in sorted(self.epochs.items())},
            "duplicates": self.duplicates,
            "lost": self.lost,
            "first_violation": None
            if self.first is None
            else {
                "kind": self.first.kind,
                "epoch": self.first.epoch,
                "position": self.first.position,
                "seen": [list(x) for x in self.first.seen],
                "message": str(self.first),
            },
            "truncated": list(self.truncated),
        }


@dataclass
class _Segment:
    """One rank's records from one BEGIN to the next."""

    begin: Begin
    file: str
    skips: list[tuple[int, int]] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)  # epochs it reported END for


def _segments(files: list[RecordFile]) -> list[_Segment]:
    out: list[_Segment] = []
    for f in files:
        current: _Segment | None = None
        for rec in f.records:
            if isinstance(rec, Begin):
                current = _Segment(rec, f.path.name)
                out.append(current)
            elif current is None:
                raise ValueError(f"{f.path}: a record before any BEGIN")
            elif isinstance(rec, SkipRange):
                current.skips.append((rec.lo, rec.hi))
            elif isinstance(rec, Batch):
                current.batches.append(rec)
            elif isinstance(rec, End):
                current.ended.append(rec.epoch)
    return out


def _runs(segments: list[_Segment]) -> list[list[_Segment]]:
    """Group segments into runs (module docstring), ordered by earliest wall time."""
    by_key: dict[tuple[int, int, int, int], dict[int, list[_Segment]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for seg in sorted(segments, key=lambda s: s.begin.time_ns):
        b = seg.begin
        by_key[(b.epoch, b.start, b.step, b.world_size)][b.rank].append(seg)
    runs: list[list[_Segment]] = []
    for per_rank in by_key.values():
        attempts = max(len(v) for v in per_rank.values())
        for k in range(attempts):
            runs.append([segs[k] for segs in per_rank.values() if k < len(segs)])
    return sorted(runs, key=lambda run: min(s.begin.time_ns for s in run))


def audit(directory: str | os.PathLike[str]) -> AuditReport:
    """Audit the delivery record in ``directory`` (see the module docstring)."""
    paths = record_files(directory)
    if not paths:
        raise FileNotFoundError(f"no delivery record files (*.sfkeys) in {directory}")
    files = [read_records(p) for p in paths]
    runs = _runs(_segments(files))
    big = 1 << 62
    # rows: epoch, position, rank, step, run, file number
    cols: list[list[np.ndarray]] = [[] for _ in range(6)]
    names: list[str] = []
    sizes: dict[int, int] = {}
    skipped: dict[int, list[tuple[int, int]]] = defaultdict(list)
    ended: set[int] = set()
    starts: list[tuple[int, int]] = []
    per_global: dict[int, int] = {}
    for r, run in enumerate(runs):
        starts.append((run[0].begin.epoch, run[0].begin.start))
        for seg in run:
            b = seg.begin
            sizes[b.epoch] = b.n
            per_global[r] = b.world_size * b.batch_size
            skipped[b.epoch].extend(seg.skips)
            names.append(seg.file)
            fnum = len(names) - 1
            share = RankShare(Sequential(b.n), b.start, b.rank, b.world_size, b.uneven, tuple(seg.skips))
            for batch in seg.batches:
                k = (batch.step - b.step) * b.batch_size + np.arange(batch.count, dtype=np.int64)
                if batch.epoch != b.epoch or batch.step < b.step or (len(k) and k[-1] >= len(share)):
                    raise ValueError(
                        f"{seg.file}: a batch at step {batch.step} of {batch.count} positions lies outside "
                        f"the share its BEGIN describes (epoch {b.epoch} from step {b.step})"
                    )
                pos = share.positions(k)
                real = pos[~share.padded(k)]
                cols[0].append(np.full(len(real), batch.epoch, np.int64))
                cols[1].append(real)
                cols[2].append(np.full(len(real), b.rank, np.int64))
                cols[3].append(np.full(len(real), batch.step, np.int64))
                cols[4].append(np.full(len(real), r, np.int64))
                cols[5].append(np.full(len(real), fnum, np.int64))
    epoch, position, rank, step, run_of, file_of = (
        np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols
    )
    n_max = max(sizes.values(), default=0) + 1
    key = epoch * n_max + position
    # valid while no later run starts at or before it: suffix minimum of the runs' start keys
    start_keys = np.array([e * n_max + p for e, p in starts] + [big], np.int64)
    later_min = np.minimum.accumulate(start_keys[::-1])[::-1]  # later_min[r]: min over runs >= r
    keep = key < later_min[run_of + 1]
    epoch, position, rank, step, run_of, file_of, key = (
        a[keep] for a in (epoch, position, rank, step, run_of, file_of, key)
    )
    for r, run in enumerate(runs):
        for seg in run:
            for e in seg.ended:
                if (e + 1) * n_max <= later_min[r + 1]:  # a later run did not roll it back
                    ended.add(e)
    order = np.argsort(key, kind="stable")
    epoch, position, rank, step, file_of, key = (
        a[order] for a in (epoch, position, rank, step, file_of, key)
    )
    later_epochs = set(np.unique(epoch).tolist())
    violations: list[Violation] = []
    counts: dict[int, dict[str, int]] = {}
    duplicates = lost = 0
    for e in sorted(sizes):
        lo, hi = np.searchsorted(key, [e * n_max, (e + 1) * n_max])
        pos = position[lo:hi]
        n = sizes[e]
        kept = Kept(n, tuple(skipped.get(e, ())))
        uniq, first_at, times = np.unique(pos, return_index=True, return_counts=True)
        dup = uniq[times > 1]
        duplicates += len(dup)
        if len(dup):
            p = int(dup[0])
            rows = np.flatnonzero(pos == p) + lo
            seen = tuple((int(rank[i]), int(step[i]), names[int(file_of[i])]) for i in rows)
            violations.append(Violation("duplicate", e, p, seen))
        want = np.ones(n, bool)
        for a, b in kept.skipped:
            want[a:b] = False
        delivered_skipped = uniq[~want[uniq]] if len(uniq) else uniq
        got = np.zeros(n, bool)
        got[uniq] = True
        complete = e in ended or any(x > e for x in later_epochs)
        missing = np.flatnonzero(want & ~got)
        if not complete and len(missing):
            frontier = int(uniq.max()) if len(uniq) else -1
            window = max(per_global.values(), default=1)
            missing = missing[missing + window < frontier]
        lost += len(missing)
        if len(missing):
            violations.append(Violation("lost", e, int(missing[0])))
        if len(delivered_skipped):
            p = int(delivered_skipped[0])
            rows = np.flatnonzero(pos == p) + lo
            seen = tuple((int(rank[i]), int(step[i]), names[int(file_of[i])]) for i in rows)
            violations.append(Violation("skipped", e, p, seen))
        counts[e] = {
            "n": n,
            "delivered": int(len(uniq)),
            "skipped": int(n - len(kept)),
            "duplicates": int(len(dup)),
            "lost": int(len(missing)),
            "complete": int(complete),
        }
    first = min(violations, key=lambda v: (v.epoch, v.position)) if violations else None
    truncated = tuple(f.path.name for f in files if f.truncated)
    return AuditReport(
        ok=first is None,
        files=len(files),
        runs=len(runs),
        epochs=counts,
        first=first,
        duplicates=duplicates,
        lost=lost,
        truncated=truncated,
    )

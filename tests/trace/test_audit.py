"""The delivery record (``record_keys=DIR``) and ``stallfree audit``: exactly once per epoch across
ranks, a kill and resume from an earlier checkpoint, a world-size change and skipped steps; a
planted duplicate and a planted loss are named."""

from __future__ import annotations

import itertools
import json
import os
import struct

import pytest

from stallfree.cli import main
from stallfree.loader.dataloader import DataLoader
from stallfree.loader.epoch.record import BATCH, MAGIC, read_records, record_files
from stallfree.trace.audit import audit
from tests.trace.helpers import three_stage_mixture
from tests.trace.test_skips import Numbers
from tests.zygote import run_python


def _ranks(directory, world, *, state=None, skip=(), batches=None, epochs=1, dataset=Numbers, workers=0):
    """Run ``world`` ranks in this process (one after another: positions, not timing, matter)."""
    last = None
    for rank in range(world):
        dl = DataLoader(
            dataset(), batch_size=4, shuffle=True, seed=3, world=(rank, world), num_workers=workers,
            record_keys=directory,
        )  # fmt: skip
        if state is not None:
            dl.load_state_dict(state, skip_steps=skip)
        stream = itertools.chain.from_iterable(iter(dl) for _ in range(epochs))
        for _ in itertools.islice(stream, batches):
            pass
        last = dl.state_dict()
        dl.close()
    return last


def test_kill_resume_on_fewer_ranks_and_a_skip_audit_clean(tmp_path):
    keys = tmp_path / "keys"
    checkpoint = _ranks(keys, 3, batches=3)  # the checkpoint at step 3 ...
    _ranks(keys, 3, state=checkpoint, batches=4)  # ... a run that got to step 7, then died
    resumed = _ranks(keys, 2, state=checkpoint, skip=[(5, 6)], epochs=2)  # rolled back to step 3
    report = audit(keys)
    assert report.ok, report.first
    assert report.runs == 4  # epoch 0 three times (from 0, from 12 twice), epoch 1 once
    assert report.epochs[0]["skipped"] == 12 and report.epochs[0]["lost"] == 0
    assert report.epochs[1] == {
        "n": 101,
        "delivered": 101,
        "skipped": 0,
        "duplicates": 0,
        "lost": 0,
        "complete": 1,
    }
    assert resumed["epoch"] == 2


def _append_batch(path, step: int, epoch: int, count: int) -> None:
    with open(path, "ab") as f:
        f.write(bytes([BATCH]) + struct.pack("<qqI", step, epoch, count))


def test_a_planted_duplicate_is_named_with_both_deliveries(tmp_path):
    keys = tmp_path / "keys"
    _ranks(keys, 2)
    victim = record_files(keys)[1]
    first = next(r for r in read_records(victim).records if type(r).__name__ == "Batch")
    _append_batch(victim, first.step, first.epoch, first.count)  # the same batch delivered again
    report = audit(keys)
    assert not report.ok and report.first.kind == "duplicate"
    rank = int(victim.name[4:9])
    positions = (
        DataLoader(Numbers(), batch_size=4, shuffle=True, seed=3, world=(rank, 2)).samples_at(0).positions
    )
    assert report.first.epoch == 0 and report.first.position == min(positions)
    assert [(r, s) for r, s, _ in report.first.seen] == [(rank, 0), (rank, 0)]
    assert main(["audit", str(keys)]) == 1


def test_a_planted_loss_is_named(tmp_path, capsys):
    keys = tmp_path / "keys"
    _ranks(keys, 2)
    victim = record_files(keys)[0]
    data = victim.read_bytes()
    dropped = bytes([BATCH]) + struct.pack("<qqI", 5, 0, 4)  # rank 0's step 5 goes missing
    assert data.count(dropped) == 1
    victim.write_bytes(data.replace(dropped, b""))
    report = audit(keys)
    assert not report.ok and report.first.kind == "lost"
    positions = (
        DataLoader(Numbers(), batch_size=4, shuffle=True, seed=3, world=(0, 2)).samples_at(5).positions
    )
    assert report.first.position == min(positions)
    assert main(["audit", str(keys), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_violation"]["kind"] == "lost" and out["lost"] == 4


def test_a_batch_outside_its_share_is_malformed(tmp_path):
    keys = tmp_path / "keys"
    _ranks(keys, 1, batches=3)
    _append_batch(record_files(keys)[0], 400, 0, 4)
    with pytest.raises(ValueError, match="outside the share"):
        audit(keys)


def test_a_scheduled_mixture_with_workers_audits_clean_and_a_cut_tail_is_read(tmp_path):
    keys = tmp_path / "keys"
    state = _ranks(keys, 2, dataset=three_stage_mixture, workers=1, batches=5)
    _ranks(keys, 3, dataset=three_stage_mixture, state=state, epochs=2)
    victim = record_files(keys)[-1]
    with open(victim, "ab") as f:
        f.write(bytes([BATCH]) + b"\x00\x01")  # a record cut short by a kill
    report = audit(keys)
    assert report.ok, report.first
    assert report.truncated == (victim.name,)
    assert report.epochs[0]["complete"] == 1 and report.epochs[1]["delivered"] == 97


def test_a_killed_rank_leaves_a_record_the_audit_reads(tmp_path):
    """A rank killed mid-epoch (SIGKILL: nothing flushed at exit) keeps every batch up to its last
    saved state; the batches after it, which a resume from that state rolls back, may be lost."""
    keys = tmp_path / "keys"
    child = f"""
import itertools, json, os, signal, sys
sys.path.insert(0, {os.getcwd()!r})
from stallfree.loader.dataloader import DataLoader
from tests.trace.test_skips import Numbers
from tests.zygote import run_python
dl = DataLoader(Numbers(), batch_size=4, shuffle=True, seed=3, record_keys={str(keys)!r})
it = iter(dl)
for _ in itertools.islice(it, 7):
    pass
print(json.dumps(dl.state_dict()), flush=True)  # a checkpoint
for _ in itertools.islice(it, 2):
    pass
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = run_python(child, timeout=120)  # torch preloaded (tests/zygote.py)
    assert proc.returncode == -9, proc.stderr
    records = read_records(record_files(keys)[0]).records
    assert [type(r).__name__ for r in records] == ["Begin"] + ["Batch"] * 7  # up to the checkpoint
    state = json.loads(proc.stdout)
    report = audit(keys)
    assert report.ok and report.epochs[0]["delivered"] == 28 and not report.epochs[0]["complete"]
    _ranks(keys, 1, state=state)  # resumed from the checkpoint: the epoch completes exactly once
    report = audit(keys)
    assert report.ok and report.epochs[0]["complete"] and report.epochs[0]["delivered"] == 101


def test_not_a_record_is_a_clear_error(tmp_path):
    (tmp_path / "x.sfkeys").write_bytes(b"not one")
    with pytest.raises(ValueError, match="not a stallfree delivery record"):
        audit(tmp_path)
    with pytest.raises(FileNotFoundError, match="no delivery record"):
        audit(tmp_path / "empty")
    assert MAGIC.startswith(b"SFKEYS")

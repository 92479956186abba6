"""The pool's first batch made in the main process before any worker starts (``inline_first.py``):
where it applies, the same batches byte for byte as the workers make them, the same failures, and
where it must not apply, every batch still made in a worker."""

from __future__ import annotations

import multiprocessing as mp
import os
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import stallfree
from stallfree import ImageDecode, open_dataset
from stallfree.errors import BatchDecodeError
from stallfree.testing.images import jpeg_bytes
from tests.zygote import run_python

N = 24
BATCH = 4


class Recording(ImageDecode):
    """Our CPU decoder, noting for each batch the process that decoded it, its first key and the
    worker processes that process had running (one line per batch, appended to ``log``)."""

    def __init__(self, log: str, **kw) -> None:
        super().__init__(train=True, size=32, backend="cpu", dtype="uint8", **kw)
        self.log = log

    def decode_batch(self, samples, *, seed, alloc=None):
        out = super().decode_batch(samples, seed=seed, alloc=alloc)
        children = ",".join(str(p.pid) for p in mp.active_children()) or "-"
        line = f"{os.getpid()} {children} {out['__key__'][0]}\n"
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return out


def _decodes(log: Path) -> list[tuple[int, set[int], str]]:
    """(pid, its running children's pids, first key) per decoded batch."""
    if not log.exists():
        return []
    return [
        (int(p), {int(c) for c in cs.split(",") if c != "-"}, k)
        for p, cs, k in (line.split() for line in log.read_text().splitlines())
    ]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inline-first") / "ds"
    with stallfree.ShardWriter(str(root), format="tar", max_samples=8) as w:
        for i, data in enumerate(jpeg_bytes(N, seed=3, sizes=((96, 72), (64, 80), (120, 90)))):
            w.write({"__key__": f"k{i:03d}", "jpg": data, "cls": str(i).encode()})
    return root


def _loader(shards: Path, decode: ImageDecode, **kw) -> stallfree.DataLoader:
    return stallfree.DataLoader(
        open_dataset(str(shards)), batch_size=BATCH, shuffle=True, seed=5, num_workers=2, decode=decode, **kw
    )


def _no_op_init(worker_id: int) -> None:
    """A worker_init_fn that does nothing: enough to keep the first batch in a worker."""


def test_the_first_batch_is_made_here_before_any_worker_starts_and_only_it(shards, tmp_path):
    log = tmp_path / "decodes"
    loader = _loader(shards, Recording(str(log)))
    for epoch in range(2):  # not persistent: each epoch's pool starts the same way
        log.unlink(missing_ok=True)
        batches = [b["__key__"] for b in loader]
        assert sorted(k for b in batches for k in b) == [f"k{i:03d}" for i in range(N)]
        here = [d for d in _decodes(log) if d[0] == os.getpid()]
        elsewhere = [d for d in _decodes(log) if d[0] != os.getpid()]
        assert [d[2] for d in here] == [batches[0][0]], f"epoch {epoch}"
        assert sorted(d[2] for d in elsewhere) == sorted(b[0] for b in batches[1:])
        workers = {d[0] for d in elsewhere}
        assert len(workers) == 2 and not workers & here[0][1]  # neither had started then


def test_a_persistent_pool_makes_only_its_first_epochs_first_batch_here(shards, tmp_path):
    log = tmp_path / "decodes"
    loader = _loader(shards, Recording(str(log)), persistent_workers=True)
    first = [b["__key__"][0] for b in loader]
    here = [d[2] for d in _decodes(log) if d[0] == os.getpid()]
    log.unlink()
    second = [b["__key__"][0] for b in loader]
    assert here == first[:1]
    assert sorted(d[2] for d in _decodes(log)) == sorted(second)
    assert all(d[0] != os.getpid() for d in _decodes(log))


def test_no_decode_thread_is_left_running_here_when_the_workers_fork(shards, tmp_path):
    """The decoder's threads stop before the fork: a worker inherits no pool without threads
    (with num_threads given, use_threads changes nothing and only close() stops them)."""

    def decode_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("stallfree-decode")}

    others = decode_threads()  # decoders of earlier tests in this process may still be alive
    loader = _loader(shards, Recording(str(tmp_path / "decodes"), num_threads=2))
    it = iter(loader)
    assert decode_threads() - others == set()
    keys = [k for b in it for k in b["__key__"]]
    assert sorted(keys) == [f"k{i:03d}" for i in range(N)]


def _epoch(loader) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    keys, labels, images = [], [], []
    for b in loader:
        keys += b["__key__"]
        labels.append(b["label"])
        images.append(b["image"].clone())
    return keys, torch.cat(labels), torch.cat(images)


def test_batches_are_the_same_bytes_as_when_every_batch_is_made_in_a_worker(shards, tmp_path):
    inline, in_workers = Recording(str(tmp_path / "a")), Recording(str(tmp_path / "b"))
    keys, labels, images = _epoch(_loader(shards, inline))
    keys_w, labels_w, images_w = _epoch(_loader(shards, in_workers, worker_init_fn=_no_op_init))
    assert keys == keys_w and torch.equal(labels, labels_w)
    assert images.dtype == torch.uint8 and torch.equal(images, images_w)
    assert inline.stats()["images"] == BATCH and in_workers.stats()["images"] == 0
    # into a tensor of its own: the decoder's pool keeps no batch-sized buffer in this process
    assert inline.stats()["buffers_allocated"] == 0


@pytest.mark.parametrize(
    "variant",
    ["worker_init_fn", "not_ours"],
)
def test_where_it_could_change_what_the_user_sees_every_batch_is_made_in_a_worker(shards, tmp_path, variant):
    log = tmp_path / "decodes"
    if variant == "worker_init_fn":  # it may set the dataset up for its worker: it runs first
        loader = _loader(shards, Recording(str(log)), worker_init_fn=_no_op_init)
    else:  # a dataset of the user's: its reads may have side effects
        ds = open_dataset(str(shards))
        samples = [ds[i] for i in range(N)]
        loader = stallfree.DataLoader(
            samples, batch_size=BATCH, shuffle=True, seed=5, num_workers=2, decode=Recording(str(log))
        )
    assert len([k for b in loader for k in b["__key__"]]) == N
    assert len(_decodes(log)) == N // BATCH
    assert all(d[0] != os.getpid() for d in _decodes(log))


@pytest.fixture(scope="module")
def bad_first(tmp_path_factory) -> Path:
    """Unshuffled, so batch 0 holds the bad sample k001 (its JPEG cut short)."""
    root = tmp_path_factory.mktemp("inline-first-bad") / "ds"
    with stallfree.ShardWriter(str(root), format="tar", max_samples=8) as w:
        for i, data in enumerate(jpeg_bytes(12, seed=4, sizes=((96, 72),))):
            w.write({"__key__": f"k{i:03d}", "jpg": data[: len(data) // 3] if i == 1 else data, "cls": b"0"})
    return root


def _bad_loader(root: Path, inline: bool, on_error: str) -> stallfree.DataLoader:
    return stallfree.DataLoader(
        open_dataset(str(root)),
        batch_size=BATCH,
        shuffle=False,
        num_workers=2,
        decode=ImageDecode(train=False, size=32, backend="cpu", dtype="uint8"),
        on_error=on_error,
        worker_init_fn=None if inline else _no_op_init,
    )


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "in_worker"])
def test_a_bad_sample_in_the_first_batch_raises_names_it_and_the_epoch_goes_on(bad_first, inline):
    it = iter(_bad_loader(bad_first, inline, "raise"))
    with pytest.raises(BatchDecodeError, match=r"k001") as caught:
        next(it)
    assert "cannot decode image" in str(caught.value) or "truncated" in str(caught.value).lower()
    assert [k for b in it for k in b["__key__"]] == [f"k{i:03d}" for i in range(4, 12)]


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "in_worker"])
def test_a_bad_sample_in_the_first_batch_is_skipped_and_counted(bad_first, inline):
    loader = _bad_loader(bad_first, inline, "skip")
    keys = [k for b in loader for k in b["__key__"]]
    assert keys == [f"k{i:03d}" for i in range(12) if i != 1]
    stats = loader.stats()
    assert stats["failures"] == 1 and stats["failed_keys"] == ["k001"]


def test_spawned_workers_start_after_a_first_batch_made_here(shards, tmp_path):
    log = tmp_path / "decodes"
    loader = _loader(shards, Recording(str(log)), multiprocessing_context="spawn")
    batches = [b["__key__"] for b in loader]
    assert sorted(k for b in batches for k in b) == [f"k{i:03d}" for i in range(N)]
    assert [d[2] for d in _decodes(log) if d[0] == os.getpid()] == [batches[0][0]]


def test_an_interrupt_during_the_first_batch_leaves_no_worker_behind(shards, tmp_path):
    """Ctrl-C while the main process decodes the first batch: no worker was started, the next
    iterator works (in a subprocess: a hang fails the test, not the suite)."""
    code = textwrap.dedent(
        f"""
        import multiprocessing as mp, os
        import stallfree
        from stallfree import ImageDecode, open_dataset

        class Interrupted(ImageDecode):
            calls = 0
            def decode_batch(self, samples, *, seed, alloc=None):
                Interrupted.calls += 1
                if os.getpid() == MAIN and Interrupted.calls == 1:
                    raise KeyboardInterrupt
                return super().decode_batch(samples, seed=seed, alloc=alloc)

        MAIN = os.getpid()
        loader = stallfree.DataLoader(
            open_dataset({str(shards)!r}), batch_size=4, shuffle=True, seed=5, num_workers=2,
            decode=Interrupted(train=True, size=32, backend="cpu", dtype="uint8"),
        )
        try:
            iter(loader)
        except KeyboardInterrupt:
            print("interrupted", len(mp.active_children()))
        print("then", len([k for b in loader for k in b["__key__"]]))
        """
    )
    out = run_python(code, timeout=120)  # a fresh interpreter, torch preloaded (tests/zygote.py)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interrupted", "0", "then", str(N)]

"""Node-local staging of whole shards (``storage/staging.py``, ``shards/staged_reads.py``) against a
real S3 API server (moto in its own process); requests counted at the server. Block order over a
bucket read sample by sample cost one GET per sample; staged, each shard file is fetched once
per node, and the next epoch reads nothing remote."""

import collections
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from stallfree import DataLoader
from stallfree.errors import ChecksumMismatchError, HashMismatchError
from stallfree.shards.manifest.model import Manifest
from stallfree.shards.open import open_dataset
from stallfree.shards.staged_reads import StagedShards
from stallfree.shards.writer import ShardWriter
from stallfree.storage.staging import Staging, StagingArea, StagingFullError
from tests.zygote import run_python

TIMEOUT = 120
SHARDS, PER_SHARD = 8, 10


def _write(s3, url, shards=SHARDS, per_shard=PER_SHARD):
    samples = {}
    with ShardWriter(url, format="tar", max_samples=per_shard, **s3.storage_options) as w:
        for i in range(shards * per_shard):
            key = f"s{i:03d}"
            samples[key] = os.urandom(1500 + 7 * i)
            w.write({"__key__": key, "bin": samples[key], "cls": i % 4})
    return samples


def _keys(batch):
    return [(s["__key__"], s["bin"]) for s in batch]


def _counts(s3):
    """GETs per object name (``shard-000003.tar``) since the last reset."""
    return collections.Counter(r.path.rsplit("/", 1)[-1] for r in s3.requests() if r.method == "GET")


def _shard_gets(s3):
    """GETs per shard object (the manifest a process opens aside)."""
    return collections.Counter({k: n for k, n in _counts(s3).items() if k != "manifest.json"})


def _dataset(s3, shards):
    """A bucket of its own holding ``shards`` shards (``_write``): (url, samples)."""
    bucket = f"bkt-staging-{os.getpid()}-{shards}"
    s3.create_bucket(bucket)
    url = f"s3://{bucket}/ds"
    return url, _write(s3, url, shards=shards)


@pytest.fixture(scope="module")
def written(s3):
    """The 8-shard dataset, written once for the tests that only read it (each opens it afresh,
    stages it into its own directory and resets the request log before it counts); a test that
    changes an object or the manifest writes its own."""
    return _dataset(s3, SHARDS)


@pytest.fixture(scope="module")
def written2(s3):
    """``written`` with 2 shards."""
    return _dataset(s3, 2)


def test_block_epochs_fetch_each_shard_once_then_nothing(s3, written, tmp_path):
    url, samples = written
    ds = open_dataset(url, **s3.storage_options)
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=0, collate_fn=_keys,
                    persistent_workers=True, staging=str(tmp_path / "stage"))  # fmt: skip
    assert dl._plan.order == "block" and dl._plan.worker.staging.root == str(tmp_path / "stage")
    for epoch in range(2):
        s3.reset()
        dl.set_epoch(epoch)
        got = [item for batch in dl for item in batch]
        assert sorted(k for k, _ in got) == sorted(samples)  # every sample exactly once
        assert all(data == samples[k] for k, data in got)
        gets = _counts(s3)
        if epoch == 0:  # two workers, one node: each shard fetched once, in one GET; its .idx
            # never (the copy is checked against the manifest's sha256, its index scanned from it)
            assert gets == collections.Counter(f"shard-{s:06d}.tar" for s in range(SHARDS))
        else:  # everything staged: the warm epoch asks the bucket for nothing
            assert gets == collections.Counter()
    del dl


def test_staging_is_on_by_default_for_block_order_only(s3, written2):
    url, _ = written2
    ds = open_dataset(url, **s3.storage_options)
    block = DataLoader(ds, batch_size=4, shuffle=True, num_workers=1)
    assert block._plan.order == "block" and block._plan.worker.staging == Staging()
    assert (
        DataLoader(ds, batch_size=4, shuffle=True, num_workers=1, order="global")._plan.worker.staging is None
    )
    assert (
        DataLoader(ds, batch_size=4, shuffle=True, num_workers=1, staging=False)._plan.worker.staging is None
    )
    assert DataLoader(ds, batch_size=4, shuffle=True, num_workers=0)._plan.worker.staging is None
    with pytest.raises(ValueError, match="staging must be None, a bool, a directory or a Staging"):
        DataLoader(ds, batch_size=4, shuffle=True, staging=3)


def test_resume_mid_window_is_exact(s3, written, tmp_path):
    url, samples = written
    ds = open_dataset(url, **s3.storage_options)

    def loader():
        return DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=5, collate_fn=_keys,
                          staging=str(tmp_path / "stage"))  # fmt: skip

    full = [k for batch in loader() for k, _ in batch]
    it = iter(dl := loader())
    first = [k for _ in range(5) for k, _ in next(it)]  # 20 samples: inside the first window of 8 shards
    state = json.loads(json.dumps(dl.state_dict()))
    del it
    again = loader()
    again.load_state_dict(state)
    rest = [k for batch in again for k, _ in batch]
    assert first + rest == full  # the same order, nothing lost or repeated
    assert sorted(full) == sorted(samples)


def test_staging_stays_within_its_cap(s3, written, tmp_path):
    url, samples = written
    ds = open_dataset(url, **s3.storage_options)
    sizes = [s.bytes for s in ds.manifest.shards]
    cap = int(2.5 * max(sizes)) + 4096  # two shards and their indexes, not three
    with ThreadPoolExecutor(4) as pool:
        staged = StagedShards(ds, Staging(root=str(tmp_path), cap_bytes=cap), pool, keep_open=1)
        area = StagingArea(str(tmp_path), cap)
        for s in range(SHARDS):  # one shard at a time, each read whole
            rows = range(s * PER_SHARD, (s + 1) * PER_SHARD)
            got = staged.get_many(list(rows))
            assert {g["__key__"]: g["bin"] for g in got} == {
                k: samples[k] for k in (f"s{i:03d}" for i in rows)
            }
            assert area.staged_bytes() <= cap
        staged.close()
    names = sorted(
        n for n in os.listdir(area.path_of(ds.fingerprint, "x").rsplit("/", 1)[0]) if n.endswith(".tar")
    )
    assert names == [f"shard-{s:06d}.tar" for s in (SHARDS - 2, SHARDS - 1)]  # the least recently used went


@pytest.mark.parametrize("digest", ["xxh3-128", "sha256"])
def test_a_changed_object_is_an_error_not_wrong_data(s3, bucket, tmp_path, digest):
    """Checked against the manifest's xxh3-128, or its sha256 where it records no xxh3-128 (a
    manifest written before it was recorded)."""
    url = f"s3://{bucket}/ds"
    _write(s3, url, shards=2)
    if digest == "sha256":
        manifest = Manifest.load(url, **s3.storage_options)
        manifest.shards = [dataclasses.replace(info, xxh3_128=None) for info in manifest.shards]
        manifest.save(url, **s3.storage_options)
    ds = open_dataset(url, **s3.storage_options)
    assert all(bool(info.xxh3_128) == (digest == "xxh3-128") for info in ds.manifest.shards)
    fs = s3.filesystem()
    key = f"{bucket}/ds/shard-000001.tar"
    data = bytearray(fs.cat_file(key))
    data[1536] ^= 0xFF  # inside the first member's data: same size, same names, other bytes
    fs.pipe_file(key, bytes(data))
    with ThreadPoolExecutor(2) as pool:
        staged = StagedShards(ds, Staging(root=str(tmp_path)), pool)
        assert len(staged.get_many(list(range(PER_SHARD)))) == PER_SHARD  # shard 0 is intact
        with pytest.raises(HashMismatchError, match=rf"shard-000001\.tar .*changed: {digest} of") as info:
            staged.get_many([PER_SHARD])
        staged.close()
    assert info.value.shard == "shard-000001.tar"
    staged_names = os.listdir(os.path.dirname(StagingArea(str(tmp_path)).path_of(ds.fingerprint, "x")))
    assert "shard-000001.tar" not in staged_names and "shard-000000.tar" in staged_names


def test_a_changed_object_fails_the_loader_in_a_subprocess(s3, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    _write(s3, url, shards=2)
    fs = s3.filesystem()
    key = f"{bucket}/ds/shard-000000.tar"
    data = bytearray(fs.cat_file(key))
    data[1536] ^= 0xFF
    script = textwrap.dedent(f"""
        import json, sys
        from stallfree import DataLoader
        from stallfree.shards.open import open_dataset
        ds = open_dataset({url!r}, **json.loads(sys.argv[1]))
        import s3fs
        fs = s3fs.S3FileSystem(**json.loads(sys.argv[1]))
        fs.pipe_file({key!r}, open(sys.argv[2], "rb").read())  # rewritten after the dataset was opened
        dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, staging=sys.argv[3],
                        collate_fn=lambda b: [s["__key__"] for s in b])
        try:
            list(dl)
        except Exception as exc:
            print("RAISED", type(exc).__name__, exc)
            sys.exit(3)
        print("NO ERROR")
    """)
    (tmp_path / "changed.tar").write_bytes(bytes(data))
    opts = json.dumps(s3.storage_options)
    done = run_python(script, opts, str(tmp_path / "changed.tar"), str(tmp_path / "stage"), timeout=TIMEOUT)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RAISED HashMismatchError" in done.stdout and "shard-000000.tar" in done.stdout, done.stdout


_SHARE = textwrap.dedent("""
    import json, sys
    from concurrent.futures import ThreadPoolExecutor
    from stallfree.shards.open import open_dataset
    from stallfree.shards.staged_reads import StagedShards
    from stallfree.storage.staging import Staging
    ds = open_dataset(sys.argv[1], **json.loads(sys.argv[2]))
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    with ThreadPoolExecutor(8) as pool:
        staged = StagedShards(ds, Staging(root=sys.argv[3]), pool)
        got = staged.get_many(list(range(len(ds)))[::-1])
        staged.close()
    print(json.dumps(sorted(g["__key__"] for g in got)))
""")


def test_two_processes_of_a_node_share_one_staging_dir(s3, written, tmp_path):
    url, samples = written
    opts = json.dumps(s3.storage_options)
    procs = [
        subprocess.Popen([sys.executable, "-c", _SHARE, url, opts, str(tmp_path / "stage")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]  # datasets opened
    s3.reset()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == sorted(samples)
    tars = [f"shard-{s:06d}.tar" for s in range(SHARDS)]
    assert _counts(s3) == collections.Counter(tars)  # fetched once for both processes


_DIE = textwrap.dedent("""
    import os, sys
    from stallfree.storage.staging import StagingArea
    def fill(f):
        f.write(b"half of it")
        f.flush()
        print("filling", flush=True)
        sys.stdin.readline()
        os._exit(9)  # dies holding the claim, the file half written
    StagingArea(sys.argv[1]).stage("ns", "a/shard.tar", fill, size=64)
""")


def test_a_dead_fetchers_claim_is_taken_over_and_its_half_file_never_seen(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _DIE, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "filling"
    area = StagingArea(str(tmp_path))
    final = area.path_of("ns", "a/shard.tar")
    assert not os.path.exists(final)  # half-written: not visible under its name
    proc.stdin.write("die\n")
    proc.stdin.flush()
    assert proc.wait(TIMEOUT) == 9
    with area.stage("ns", "a/shard.tar", produce=lambda: b"the whole file") as staged:
        assert open(staged.path, "rb").read() == b"the whole file"
    area.trim()  # sweeps the dead writer's partial file
    assert os.listdir(os.path.dirname(final)) == ["a%2Fshard.tar"]


def test_a_pinned_file_is_never_evicted_and_the_cap_still_holds(tmp_path):
    area = StagingArea(str(tmp_path), cap_bytes=10)
    with area.stage("ns", "one", produce=lambda: b"x" * 8) as one:
        with pytest.raises(StagingFullError, match=r"no room to stage .*two \(8 bytes\) under the cap of 10"):
            area.stage("ns", "two", produce=lambda: b"y" * 8)  # "one" is in use: it cannot go
        assert os.path.exists(one.path) and not os.path.exists(area.path_of("ns", "two"))
        assert area.staged_bytes() == 8
    with area.stage("ns", "two", produce=lambda: b"y" * 8) as two:  # "one" unpinned: evicted for it
        assert open(two.path, "rb").read() == b"y" * 8
    assert not os.path.exists(area.path_of("ns", "one")) and area.staged_bytes() == 8


def test_the_next_window_is_staged_ahead_and_no_further(s3, written, tmp_path):
    from stallfree.loader.epoch.order import Blocked, ramp_of

    url, _ = written
    ds = open_dataset(url, **s3.storage_options)
    stage = tmp_path / "stage"
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=1, seed=0, window=2, collate_fn=_keys,
                    staging=str(stage), persistent_workers=True)  # fmt: skip
    # staged windows: the first is ramp_of(2) = 1 shard, then 2 each (window_bounds)
    order = Blocked(0, 0, tuple(ds.shard_sizes), window=2, first=ramp_of(2))
    expect = {f"shard-{s:06d}.tar" for w in (0, 1) for s in order.window_shards(w)}
    it = iter(dl)
    next(it)  # the first of window 0's batches: the backlog holds only window 0's batches
    folder = stage / ds.fingerprint

    def staged():
        return {n for n in os.listdir(folder) if n.endswith(".tar")} if folder.exists() else set()

    deadline = time.monotonic() + TIMEOUT  # a bound on a hang, not a speed requirement
    while staged() != expect and time.monotonic() < deadline:
        time.sleep(0.05)
    assert staged() == expect  # window 1 staged ahead; windows 2 and 3 not yet
    del it, dl


def _staged_samples(ds, root):
    """Every sample of two shards read through a fresh staging area at ``root``: key -> bin."""
    with ThreadPoolExecutor(2) as pool:
        staged = StagedShards(ds, Staging(root=str(root)), pool)
        got = staged.get_many(list(range(2 * PER_SHARD)))
        staged.close()
    return {g["__key__"]: g["bin"] for g in got}


def test_without_a_recorded_digest_the_stored_index_is_staged(s3, bucket, tmp_path):
    """A manifest without digests (``stallfree index`` over tars other tools wrote) cannot vouch for
    the staged copy, so its index is not rebuilt from it: the stored ``.idx`` is fetched beside it
    (and checked against the copy's headers as it opens)."""
    url = f"s3://{bucket}/ds"
    samples = _write(s3, url, shards=2)
    manifest = Manifest.load(url, **s3.storage_options)
    manifest.shards = [dataclasses.replace(info, sha256=None, xxh3_128=None) for info in manifest.shards]
    manifest.save(url, **s3.storage_options)
    ds = open_dataset(url, **s3.storage_options)
    assert all(info.sha256 is None and info.xxh3_128 is None for info in ds.manifest.shards)
    s3.reset()
    assert _staged_samples(ds, tmp_path) == samples
    names = [f"shard-{s:06d}.{ext}" for s in range(2) for ext in ("tar", "idx")]
    assert _counts(s3) == collections.Counter(names)


def test_verify_samples_reads_the_staged_sums(s3, bucket, tmp_path):
    url = f"s3://{bucket}/ds"
    samples = _write(s3, url, shards=2)
    ds = open_dataset(url, verify_samples=True, **s3.storage_options)
    s3.reset()
    assert _staged_samples(ds, tmp_path) == samples
    names = [f"shard-{s:06d}.{ext}" for s in range(2) for ext in ("tar", "sums")]
    assert _counts(s3) == collections.Counter(names)
    fs = s3.filesystem()  # a recorded checksum that disagrees: the staged read checks members
    sums = bytearray(fs.cat_file(f"{bucket}/ds/shard-000001.sums"))
    sums[-1] ^= 0xFF
    fs.pipe_file(f"{bucket}/ds/shard-000001.sums", bytes(sums))
    with ThreadPoolExecutor(2) as pool:
        staged = StagedShards(ds, Staging(root=str(tmp_path / "fresh")), pool)
        with pytest.raises(ChecksumMismatchError) as info:
            staged.get_many([2 * PER_SHARD - 1])
        staged.close()
    assert info.value.shard == "shard-000001.tar" and info.value.key == "s019"


def test_a_worker_fetches_its_share_of_a_window_first_then_the_rest(s3, written, tmp_path):
    url, samples = written
    ds = open_dataset(url, **s3.storage_options)
    s3.reset()
    with ThreadPoolExecutor(8) as pool:  # worker 1 of 2, alone: no other worker takes the rest
        staged = StagedShards(ds, Staging(root=str(tmp_path)), pool, share=(1, 2))
        got = staged.get_many(list(range(len(ds))))
        staged.close()
    assert {g["__key__"]: g["bin"] for g in got} == samples
    order = [
        r.path.rsplit("/", 1)[-1] for r in s3.requests() if r.method == "GET" and r.path.endswith(".tar")
    ]
    assert sorted(order[:4]) == [f"shard-{s:06d}.tar" for s in (1, 3, 5, 7)]  # its share, first
    assert sorted(order[4:]) == [f"shard-{s:06d}.tar" for s in (0, 2, 4, 6)]  # then the others'


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (root only): a staging disk that fills up after a few shards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=TIMEOUT)


def test_a_full_staging_disk_falls_back_to_ranged_reads(s3, written, small_disk, caplog):
    url, samples = written
    ds = open_dataset(url, **s3.storage_options)
    with ThreadPoolExecutor(4) as pool:  # a cap far over the disk: it fills before any eviction
        staged = StagedShards(ds, Staging(root=str(small_disk), cap_bytes=10 << 20), pool)
        got = []
        for s in range(SHARDS):
            got += staged.get_many(list(range(s * PER_SHARD, (s + 1) * PER_SHARD)))
        again = staged.get_many(list(range(len(ds))))  # again: staged copies and ranged reads mixed
        staged.close()
    assert {g["__key__"]: g["bin"] for g in got} == samples == {g["__key__"]: g["bin"] for g in again}
    assert "reading unstaged shards with ranged GETs" in caplog.text and "No space left" in caplog.text


def test_the_main_process_lands_the_first_window_for_its_workers(s3, written, tmp_path):
    """``LeadStaging``: the main process fetches the epoch's first window (its client
    is connected already) while the workers start; the workers then open those copies, and
    every shard is still fetched once."""
    from stallfree.loader.epoch.order import Blocked
    from stallfree.loader.lead_staging import LeadStaging

    url, samples = written
    ds = open_dataset(url, **s3.storage_options)
    window = Blocked(0, 0, tuple(s.samples for s in ds.manifest.shards), window=4).window_shards(0)
    stage = Staging(root=str(tmp_path / "stage"))
    s3.reset()
    lead = LeadStaging(ds, stage, window.tolist())
    deadline = time.monotonic() + TIMEOUT
    while sum(_counts(s3).values()) < len(window) and time.monotonic() < deadline:
        time.sleep(0.05)
    lead.close()
    assert _counts(s3) == collections.Counter(f"shard-{s:06d}.tar" for s in window.tolist())
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=0, collate_fn=_keys,
                    staging=stage)  # fmt: skip
    s3.reset()
    got = [item for batch in dl for item in batch]
    assert sorted(k for k, _ in got) == sorted(samples) and all(d == samples[k] for k, d in got)
    fetched = _counts(s3)  # the loader's own first window is another one (window 8): the rest only
    assert all(n == 1 for n in fetched.values())
    assert set(fetched).isdisjoint(f"shard-{s:06d}.tar" for s in window.tolist())


def test_the_lead_lands_the_first_window_alone_then_each_window_once(s3, written, tmp_path):
    """``LeadStaging.ahead``: what the loader asks for while the first window is on its way
    waits for it (the first batch shares the wire with nothing), then lands; a shard asked for
    again (every dispatched batch of a window names the next one) is fetched once."""
    from stallfree.loader.lead_staging import LeadStaging

    url, _ = written
    ds = open_dataset(url, **s3.storage_options)
    first, then, later = [5, 2], [0, 7], [3, 6]
    s3.reset()
    lead = LeadStaging(ds, Staging(root=str(tmp_path / "stage")), first, then)
    lead.ahead(later)
    lead.ahead(then + later)  # asked again: nothing more
    names = {f"shard-{s:06d}.tar" for s in first + then + later}
    deadline = time.monotonic() + TIMEOUT  # a bound on a hang, not a speed requirement
    while set(_counts(s3)) != names and time.monotonic() < deadline:
        time.sleep(0.05)
    lead.ahead(later)  # and after they landed: nothing more either
    time.sleep(0.2)
    lead.close()
    gets = [r.path.rsplit("/", 1)[-1] for r in s3.requests() if r.method == "GET"]
    assert collections.Counter(gets) == collections.Counter(names)
    assert set(gets[: len(first)]) == {f"shard-{s:06d}.tar" for s in first}  # before any other
    assert set(os.listdir(tmp_path / "stage" / ds.fingerprint)) >= names


# -- issue 36: a private root, checked copies, a cap that holds ----------------------------------

_LATER_RUN = textwrap.dedent("""
    import hashlib, json, sys
    from stallfree import DataLoader
    from stallfree.shards.open import open_dataset
    ds = open_dataset(sys.argv[1], **json.loads(sys.argv[2]))
    kw = {} if sys.argv[3] == "-" else {"staging": sys.argv[3]}
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=1,
                    collate_fn=lambda b: [(s["__key__"], hashlib.sha256(s["bin"]).hexdigest()) for s in b], **kw)
    try:
        got = [item for batch in dl for item in batch]
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc)
        sys.exit(3)
    print(json.dumps(got))
""")


def _later_run(s3, url, root, timeout=TIMEOUT):
    """A later run of a loader over ``url`` in its own process (a hang fails the test): its
    (key, sha256 of bin) pairs, or the error it raised, and its stderr."""
    args = (url, json.dumps(s3.storage_options), str(root) if root else "-")
    return run_python(_LATER_RUN, *args, timeout=timeout)  # torch preloaded (tests/zygote.py)


def _digests(samples):
    import hashlib

    return {k: hashlib.sha256(v).hexdigest() for k, v in samples.items()}


def _write_uniform(s3, url, shards, per_shard, size):
    """Shards of equal size (same-length keys and payloads): a copy of one passes for another's."""
    samples = {}
    with ShardWriter(url, format="tar", max_samples=per_shard, **s3.storage_options) as w:
        for i in range(shards * per_shard):
            samples[f"s{i:03d}"] = os.urandom(size)
            w.write({"__key__": f"s{i:03d}", "bin": samples[f"s{i:03d}"]})
    return samples


def test_a_planted_default_root_is_refused_not_trained_on(s3, written2, tmp_path):
    """Another user (uid 65534) made ``stallfree-staging-<uid>`` first and put a same-size copy
    of a shard there with 64 bytes changed: the loader refuses the directory, naming it, rather
    than train on the planted sample."""
    import tempfile

    url, samples = written2
    ds = open_dataset(url, **s3.storage_options)
    root = Staging().resolved_root()
    assert root.startswith(tempfile.gettempdir())  # this test's own temp directory (conftest)
    ns = os.path.join(root, ds.fingerprint)
    os.makedirs(ns)
    data = bytearray(s3.filesystem().cat_file(url.removeprefix("s3://") + "/shard-000000.tar"))
    data[1536 : 1536 + 64] = bytes(b ^ 0xFF for b in data[1536 : 1536 + 64])
    with open(os.path.join(ns, "shard-000000.tar"), "wb") as f:
        f.write(data)
    for p in (root, ns, os.path.join(ns, "shard-000000.tar")):
        os.chown(p, 65534, 65534)
        os.chmod(p, 0o777 if os.path.isdir(p) else 0o644)
    done = _later_run(s3, url, None)
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-3000:]
    assert (
        "StagingDirError" in done.stdout and f"staging directory {root} is owned by uid 65534" in done.stdout
    )
    assert sorted(os.listdir(ns)) == ["shard-000000.tar"]  # nothing of ours written into it
    assert len(samples) == 2 * PER_SHARD


def test_the_staging_area_is_private(s3, written2, tmp_path):
    url, _ = written2
    ds = open_dataset(url, **s3.storage_options)
    root = tmp_path / "stage"
    assert sorted(_staged_samples(ds, root)) == [f"s{i:03d}" for i in range(2 * PER_SHARD)]
    ns = root / ds.fingerprint
    assert os.stat(root).st_mode & 0o777 == 0o700 and os.stat(ns).st_mode & 0o777 == 0o700
    files = [n for n in os.listdir(ns) if not n.endswith(".lock")]
    assert "shard-000000.tar" in files and ".dataset.json" in files
    assert {n: os.stat(ns / n).st_mode & 0o777 for n in files} == dict.fromkeys(files, 0o600)
    assert json.loads((ns / ".dataset.json").read_text())["url"] == url


def test_a_damaged_copy_from_an_earlier_run_is_fetched_again(s3, bucket, tmp_path):
    """Copies kept from an earlier run: one with 64 bytes flipped, one replaced by a symlink to
    another shard's copy (same size), one cut short. A later run (its own process) deletes and
    fetches each again, says which, and reads every sample once with the right bytes."""
    url = f"s3://{bucket}/ds"
    samples = _write_uniform(s3, url, shards=4, per_shard=5, size=3000)
    ds = open_dataset(url, **s3.storage_options)
    assert len({info.bytes for info in ds.manifest.shards}) == 1
    root = tmp_path / "stage"
    with ThreadPoolExecutor(2) as pool:  # the earlier run
        staged = StagedShards(ds, Staging(root=str(root)), pool)
        assert len(staged.get_many(list(range(len(ds))))) == len(samples)
        staged.close()
    ns = root / ds.fingerprint
    flipped, linked, cut = (ns / f"shard-00000{s}.tar" for s in (1, 2, 3))
    with open(flipped, "r+b") as f:  # inside the first member's data
        f.seek(1024)
        flipped_bytes = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(1024)
        f.write(flipped_bytes)
    linked.unlink()
    linked.symlink_to(ns / "shard-000000.tar")
    os.truncate(cut, os.path.getsize(cut) - 700)
    s3.reset()
    done = _later_run(s3, url, root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(k for k, _ in got) == sorted(samples)  # every sample exactly once
    assert dict(got) == _digests(samples)  # with its own bytes
    for path in (flipped, linked, cut):
        assert f"staged copy {path} is damaged" in done.stderr
    damaged = collections.Counter(p.name for p in (flipped, linked, cut))
    assert _shard_gets(s3) == damaged  # those fetched again, nothing else
    assert not linked.is_symlink()
    assert _staged_samples(ds, root) == samples  # 20 rows: all of them, sound now
    assert _shard_gets(s3) == damaged


def _tree_bytes(root):
    """Bytes of every file under ``root`` now (files vanish while it looks: they count 0)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


class _Watcher:
    """A thread that samples the size of a directory tree as often as it can; ``peak``."""

    def __init__(self, root):
        import threading

        self.root, self.peak, self.samples = root, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _tree_bytes(self.root))
            self.samples += 1

    def stop(self):
        self._stop.set()
        self._thread.join(TIMEOUT)
        return self.peak


@pytest.mark.parametrize("cap", [1 << 20, 4 << 20])
def test_the_cap_holds_during_an_epoch_and_after(s3, bucket, tmp_path, cap):
    """8 MB of shards through a 1 MB and a 4 MB cap: the staging directory never holds more
    than the cap (pinned copies and files being written counted), nor after the loader is done,
    and every sample arrives once with its bytes (shards that do not fit read remotely)."""
    url = f"s3://{bucket}/ds"
    samples = _write_uniform(s3, url, shards=16, per_shard=8, size=64 << 10)
    ds = open_dataset(url, **s3.storage_options)
    assert 7 << 20 < sum(info.bytes for info in ds.manifest.shards) < 9 << 20
    root = tmp_path / "stage"
    root.mkdir(mode=0o700)
    watcher = _Watcher(str(root))
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=0, window=4,
                    collate_fn=lambda b: [(s["__key__"], s["bin"]) for s in b],
                    staging=Staging(root=str(root), cap_bytes=cap))  # fmt: skip
    got = [item for batch in dl for item in batch]
    del dl
    peak = watcher.stop()
    assert sorted(k for k, _ in got) == sorted(samples) and all(v == samples[k] for k, v in got)
    assert watcher.samples > 1
    assert 0 < peak <= cap, f"peak {peak} over the cap {cap}"
    assert _tree_bytes(root) <= cap

"""Token files on a real S3 API (moto's server on loopback, through s3fs, as users run it) read
back window by window equal to the same files on local disk: Megatron ``.bin``/``.idx``, a raw
``.bin``, Parquet and Arrow IPC ``input_ids``. Every read goes through ``storage/remote.py``: it
used to call ``cat_file(path, lo, hi)`` positionally, which s3fs takes as ``version_id``."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch

import stallfree
from stallfree.errors import RemoteReadError
from stallfree.testing.s3serve import moto_available, serve_s3
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import random_docs, write_megatron

EOT = 50256


@pytest.fixture(scope="module")
def s3():
    reason = moto_available()
    if reason is not None:
        pytest.skip(reason)
    with serve_s3() as server:
        yield server


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory):
    """The same token files locally and in a fresh bucket: {name: (local path, s3 url, options)}."""
    root = tmp_path_factory.mktemp("tokens")
    docs = random_docs(5, n=60, max_len=90, vocab=50000)
    write_megatron(root / "mega", docs, "uint16")
    ids = np.asarray([t for d in docs for t in [*d, EOT]], np.uint16)
    ids.tofile(root / "train.bin")
    table = pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32()))})
    pq.write_table(table, root / "toks.parquet", row_group_size=17)
    with pa.OSFile(str(root / "toks.arrow"), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=23):
            w.write_batch(batch)
    bucket = f"tok-{os.getpid()}"
    s3.create_bucket(bucket)
    fs = s3.filesystem()
    for name in ("mega.bin", "mega.idx", "train.bin", "toks.parquet", "toks.arrow"):
        fs.pipe(f"{bucket}/{name}", (root / name).read_bytes())
    return root, f"s3://{bucket}"


CASES = {  # name: (source, TokenDataset keywords)
    "megatron": ("mega", {}),
    "megatron-eos": ("mega.idx", {"eos": 0}),
    "raw": ("train.bin", {"dtype": "uint16"}),
    "raw-eos": ("train.bin", {"dtype": "uint16", "eos": EOT}),
    "parquet": ("toks.parquet", {"eos": 1}),
    "arrow": ("toks.arrow", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_s3_windows_equal_the_local_files(s3, corpus, case):
    root, url = corpus
    source, kw = CASES[case]
    local = TokenDataset(str(root / source), 31, **kw)
    remote = TokenDataset(f"{url}/{source}", 31, **kw, **s3.storage_options)
    assert len(remote) == len(local) > 50
    every = list(range(len(local)))
    got, want = remote.get_batch(every), local.get_batch(every)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    for i in (0, 7, len(local) - 1):  # one window at a time too
        assert all(torch.equal(remote[i][k], local[i][k]) for k in want)


def test_s3_bin_reads_are_ranged_and_one_request_per_batch(s3, corpus):
    root, url = corpus
    remote = TokenDataset(f"{url}/mega", 31, **s3.storage_options)
    local = TokenDataset(str(root / "mega"), 31)
    s3.reset()
    batch = remote.get_batch([40, 3, 17, 29])
    assert all(torch.equal(batch[k], v) for k, v in local.get_batch([40, 3, 17, 29]).items())
    gets = [r for r in s3.requests() if r.method == "GET" and r.path.endswith("/mega.bin")]
    assert len(gets) == 4 and all(r.is_ranged_get for r in gets)  # one window each, nothing more
    assert sorted(r.range for r in gets) == sorted(
        f"bytes={w * 31 * 2}-{(w * 31 + 32) * 2 - 1}" for w in (40, 3, 17, 29)
    )


def test_s3_through_the_loader_with_workers(s3, corpus):
    root, url = corpus
    remote = TokenDataset(f"{url}/train.bin", 31, dtype="uint16", eos=EOT, **s3.storage_options)
    local = TokenDataset(str(root / "train.bin"), 31, dtype="uint16", eos=EOT)
    loader = stallfree.DataLoader(remote, batch_size=8, num_workers=2, timeout=120)
    rows = torch.cat([b["input_ids"] for b in loader])
    assert torch.equal(rows, local.get_batch(list(range(len(local))))["input_ids"][: len(rows)])
    assert len(rows) == len(local)


def test_s3_object_shrunk_after_open_names_the_url_and_range(s3, corpus):
    root, url = corpus
    bucket = url.removeprefix("s3://")
    fs = s3.filesystem()
    fs.pipe(f"{bucket}/shrinks.bin", (root / "train.bin").read_bytes())
    ds = TokenDataset(f"{url}/shrinks.bin", 31, dtype="uint16", **s3.storage_options)
    fs.pipe(f"{bucket}/shrinks.bin", (root / "train.bin").read_bytes()[:1000])  # re-uploaded shorter
    with pytest.raises(RemoteReadError) as exc:
        ds[16]  # bytes 992..1056: 8 of them are left
    err = exc.value
    assert err.url == f"{url}/shrinks.bin (endpoint {s3.endpoint_url})"
    assert (err.start, err.end, err.got) == (992, 1056, 8)
    assert str(err).startswith(f"short read from {err.url}: asked for bytes 992..1056 (64 bytes), got 8")
    with pytest.raises(RemoteReadError, match="bytes 5146..5210 .* not satisfiable"):
        ds[83]  # wholly past the new end

"""Datasets users already have from Hugging Face ``datasets``: a ``save_to_disk`` directory (Arrow
*stream* files + dataset_info.json + state.json) and a Parquet export, opened with
``open_dataset`` (locally and over S3), rows compared with the library's own reading."""

import numpy as np
import pyarrow as pa
import pytest

from stallfree.errors import CorruptShardError
from stallfree.shards.open import open_dataset

datasets = pytest.importorskip("datasets")

N = 37


def _hf_dataset():
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["cat", "dog", "eel"]),
            "score": datasets.Value("float32"),
            "blob": datasets.Value("binary"),
            "emb": datasets.Sequence(datasets.Value("float32")),
            "ids": datasets.Sequence(datasets.Value("int64")),
        }
    )
    rng = np.random.default_rng(0)
    rows = {
        "text": [f"row {i} " + "x" * (i % 7) for i in range(N)],
        "label": [i % 3 for i in range(N)],
        "score": [float(np.float32(i / 3)) for i in range(N)],
        "blob": [bytes(rng.integers(0, 256, 10 + i, dtype=np.uint8)) for i in range(N)],
        "emb": [rng.standard_normal(4).astype(np.float32).tolist() for _ in range(N)],
        "ids": [list(range(i % 5)) for i in range(N)],
    }
    return datasets.Dataset.from_dict(rows, features=features)


def _same(ours: dict, theirs: dict) -> None:
    assert set(ours) - {"__key__"} == set(theirs)
    for name, value in theirs.items():
        got = ours[name]
        if isinstance(got, np.ndarray):  # numeric lists come back as arrays, dtype kept
            assert got.dtype == {"emb": np.float32, "ids": np.int64}[name]
            np.testing.assert_array_equal(got, np.asarray(value, dtype=got.dtype))
        else:
            assert got == value and type(got) is type(value), name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf = _hf_dataset()
    hf.save_to_disk(str(root / "disk"), max_shard_size="2KB")  # several files
    hf.to_parquet(str(root / "export" / "train-00000-of-00001.parquet"), batch_size=10)
    return root, datasets.load_from_disk(str(root / "disk"))


def test_save_to_disk_files_are_the_stream_format(saved):
    root, _ = saved
    files = sorted((root / "disk").glob("*.arrow"))
    assert len(files) > 1
    with pa.memory_map(str(files[0])) as f, pytest.raises(pa.ArrowInvalid):
        pa.ipc.open_file(f)  # no footer: what failed before with "not a readable Arrow IPC file"


def test_open_save_to_disk_directory(saved):
    root, hf = saved
    ds = open_dataset(str(root / "disk"))
    assert len(ds) == N and ds.format == "arrow"
    assert {"text", "label", "score", "blob", "emb", "ids"} <= set(ds.manifest.fields)
    for i in range(N):
        _same(ds[i], hf[i])
    assert [s["text"] for s in ds] == hf["text"]  # iteration too
    assert ds[N - 1]["__key__"].endswith(f"/{hf.num_rows - 1 - sum(ds.shard_sizes[:-1])}")


def test_open_parquet_export(saved):
    root, hf = saved
    ds = open_dataset(str(root / "export" / "*.parquet"))
    assert len(ds) == N
    reader = ds._reader(0)
    assert reader.batches == 4  # batch_size=10: four row groups
    for i in [0, 36, 5, 9, 10, 21]:
        _same(ds[i], hf[i])
    for got, i in zip(ds.get_many([3, 30, 3]), [3, 30, 3], strict=True):
        _same(got, hf[i])


def test_truncated_stream_is_a_corrupt_shard(saved, tmp_path):
    root, _ = saved
    src = sorted((root / "disk").glob("*.arrow"))[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data-00000-of-00001.arrow").write_bytes(src.read_bytes()[:100])
    with pytest.raises(
        CorruptShardError, match=r"not a readable Arrow IPC file \(neither the file nor the stream format\)"
    ):
        open_dataset(str(bad))


def test_save_to_disk_over_s3_one_get_per_batch(saved):
    """Remotely a stream is walked once when opened (its batches' offsets); after that a row is one
    ranged GET of its batch's message."""
    from stallfree.testing.s3serve import moto_available, serve_s3

    reason = moto_available()
    if reason:
        pytest.skip(reason)
    root, hf = saved
    with serve_s3() as s3:
        s3.create_bucket("hf-data")
        fs = s3.filesystem()
        fs.put(str(root / "disk"), "hf-data/disk", recursive=True)
        fs.put(str(root / "export"), "hf-data/export", recursive=True)
        ds = open_dataset("s3://hf-data/disk", **s3.storage_options)
        assert len(ds) == N
        ds[0]
        s3.reset()
        _same(ds[1], hf[1])
        reqs = s3.requests()
        assert len(reqs) == 1 and reqs[0].is_ranged_get, reqs
        for i in range(N):
            _same(ds[i], hf[i])
        pq = open_dataset("s3://hf-data/export/*.parquet", **s3.storage_options)
        for i in [0, 36, 11]:
            _same(pq[i], hf[i])

"""ImageDecode's labels and other fields, on data as users have it (Hugging Face Parquet with a
ClassLabel, MosaicML MDS, LitData), read directly and after ``stallfree shard``, through
``stallfree.DataLoader`` in the main process and in 2 workers: labels exact (the label field from
the manifest's ``class_field``), a missing label an error naming the key and the fields, never
-1, and every other field carried into the batch byte-equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import stallfree
from stallfree.cli import main
from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode.sample_fields import collate_values
from stallfree.gpu_decode.select import ImageDecode
from stallfree.shards.open import open_dataset
from stallfree.testing.images import jpeg_bytes
from tests.shards.test_source_litdata import write_litdata
from tests.shards.test_source_mds import write_mds

N = 10
NAMES = ["cat", "dog", "eel"]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    images = jpeg_bytes(N, seed=8, sizes=((40, 32), (32, 40)))
    return [
        {"image": images[i], "label": (i * 7) % 3, "caption": f"photo {i} ünïcode", "id": 1000 + i}
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def sources(rows, tmp_path_factory) -> dict[str, Path]:
    """The same rows as a Hugging Face Parquet file (ClassLabel ``label``), MDS and LitData."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("fields")
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=NAMES),
            "caption": datasets.Value("string"),
            "id": datasets.Value("int64"),
        }
    )
    table = {k: [r[k] for r in rows] for k in ("label", "caption", "id")}
    table["image"] = [{"bytes": r["image"], "path": None} for r in rows]
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(root / "hf.parquet"))
    write_mds(
        root / "mds", {"image": "jpeg", "label": "int", "caption": "str", "id": "int"}, rows, per_shard=4
    )
    write_litdata(root / "litdata", [dict(r) for r in rows], per_chunk=4)
    return {"hf": root / "hf.parquet", "mds": root / "mds", "litdata": root / "litdata"}


def _open(sources: dict[str, Path], kind: str, layout: str, tmp_path: Path):
    """``kind`` read in place (``direct``) or after ``stallfree shard --format tar|arrow``."""
    if layout == "direct":
        return open_dataset(str(sources[kind]))
    out = tmp_path / f"{kind}-{layout}"
    assert main(["shard", str(sources[kind]), str(out), "--format", layout, "--no-progress"]) == 0
    return open_dataset(str(out))


def _expected(rows: list[dict], typed: bool) -> dict[int, dict]:
    """Per row: the label and the pass-through fields as the batch must hold them: Arrow and
    Parquet keep types; tar members, MDS and LitData cells read in place are bytes."""
    if typed:
        return {i: {"label": r["label"], "caption": r["caption"], "id": r["id"]} for i, r in enumerate(rows)}
    return {
        i: {"label": r["label"], "caption": r["caption"].encode(), "id": str(r["id"]).encode()}
        for i, r in enumerate(rows)
    }


def _per_row(batches) -> dict[int, dict]:
    got: dict[int, dict] = {}
    for batch in batches:
        assert batch["image"].shape[1:] == (3, 16, 16)
        fields = [f for f in batch if f not in ("image", "__key__")]
        for j, key in enumerate(batch["__key__"]):
            row = int(key.rsplit("/", 1)[-1])  # 000000003, or hf/3 for a Parquet file read in place
            assert row not in got
            got[row] = {
                f: batch[f][j].item() if isinstance(batch[f], torch.Tensor) else batch[f][j] for f in fields
            }
    return got


CASES = [
    # (source, layout, typed values, label_field to pass: None where the manifest names it)
    pytest.param("hf", "direct", True, None, 2, id="hf-parquet-direct-2w"),
    pytest.param("hf", "tar", False, None, 0, id="hf-parquet-tar-0w"),
    pytest.param("hf", "arrow", True, None, 2, id="hf-parquet-arrow-2w"),
    pytest.param("mds", "direct", False, "label", 0, id="mds-direct-0w"),
    pytest.param("mds", "arrow", True, "label", 2, id="mds-arrow-2w"),
    pytest.param("litdata", "direct", False, "label", 2, id="litdata-direct-2w"),
    pytest.param("litdata", "arrow", True, "label", 0, id="litdata-arrow-0w"),
]


@pytest.mark.parametrize("kind, layout, typed, label_field, workers", CASES)
def test_labels_exact_and_fields_pass_through(
    rows, sources, tmp_path, kind, layout, typed, label_field, workers
):
    ds = _open(sources, kind, layout, tmp_path)
    if label_field is None:
        assert ds.manifest.extra["class_field"] == "label"
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1, label_field=label_field)
    loader = stallfree.DataLoader(
        ds, batch_size=4, shuffle=True, seed=5, num_workers=workers, decode=dec.for_dataset(ds)
    )
    assert _per_row(loader) == _expected(rows, typed)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_missing_label_field_is_an_error_naming_key_and_fields(rows, sources, tmp_path, workers):
    """MDS data names its label column ``label``; its manifest records no class_field, so the
    default ``cls`` is missing: an error naming the sample and its fields, never label -1."""
    ds = _open(sources, "mds", "arrow", tmp_path)
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1).for_dataset(ds)
    loader = stallfree.DataLoader(ds, batch_size=4, shuffle=False, num_workers=workers, decode=dec)
    with pytest.raises(BatchDecodeError) as info:
        next(iter(loader))
    assert [key for _, key, _ in info.value.failures] == [f"{i:09d}" for i in range(4)]
    assert str(info.value.failures[0][2]) == (
        "no label field 'cls' (the default where no bound dataset's manifest names a class_field); the "
        "sample's fields are ['caption', 'id', 'image', 'label']: pass label_field='label', or "
        "label_field=False to decode without labels (sample '000000000')"
    )


def test_a_manifest_class_field_missing_from_a_sample_says_so(rows, sources, tmp_path):
    ds = _open(sources, "hf", "arrow", tmp_path)
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1).for_dataset(ds)
    sample = {k: v for k, v in ds[0].items() if k != "label"}
    with pytest.raises(
        BatchDecodeError, match=r"no label field 'label' \(the dataset's manifest names it as class_field\)"
    ):
        dec.decode_batch([sample], seed=0)


def test_unlabelled_decoding_keeps_the_label_column_as_a_field(rows, sources, tmp_path):
    ds = _open(sources, "mds", "arrow", tmp_path)
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1, label_field=False)
    batch = next(iter(stallfree.DataLoader(ds, batch_size=N, shuffle=False, decode=dec)))
    assert list(batch) == ["image", "__key__", "caption", "id", "label"]  # the column, passed through
    assert batch["label"].tolist() == [r["label"] for r in rows]


def test_the_loader_binds_the_dataset_without_for_dataset(rows, sources, tmp_path):
    ds = _open(sources, "hf", "arrow", tmp_path)
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1)
    batch = next(iter(stallfree.DataLoader(ds, batch_size=N, shuffle=False, decode=dec)))
    assert batch["label"].tolist() == [r["label"] for r in rows]


class Samples(torch.utils.data.Dataset):
    """Samples holding every kind of value a field can: numbers, arrays, text, bytes, JSON-ish."""

    def __init__(self, images: list[bytes]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        sample = {
            "__key__": f"s{i}",
            "jpg": self.images[i],
            "cls": str(i % 3).encode(),
            "score": i / 4,
            "count": np.int32(i),
            "flag": i % 2 == 0,
            "emb": np.full((2, 3), i, np.float16),
            "mask": torch.arange(4, dtype=torch.uint8) + i,
            "ragged": np.arange(i + 1),
            "txt": f"caption {i}",
            "raw": bytes([i]) * 2000,  # over 1 KiB: through shared memory as raw bytes
            "meta": {"i": i},
        }
        if i % 2:
            sample["sometimes"] = b"x"
        return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_every_kind_of_field_is_collated_in_both_paths(workers):
    images = jpeg_bytes(6, seed=2, sizes=((32, 32),))
    data = Samples(images)
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1)
    loader = stallfree.DataLoader(data, batch_size=3, shuffle=False, num_workers=workers, decode=dec)
    batches = list(loader)
    assert len(batches) == 2
    b = batches[1]  # samples 3, 4, 5
    assert list(b) == [
        "image", "label", "__key__", "score", "count", "flag", "emb", "mask", "ragged", "txt", "raw", "meta", "sometimes"
    ]  # fmt: skip
    assert b["label"].tolist() == [0, 1, 2] and b["__key__"] == ["s3", "s4", "s5"]
    assert b["score"].dtype == torch.float64 and b["score"].tolist() == [0.75, 1.0, 1.25]
    assert b["count"].dtype == torch.int32 and b["count"].tolist() == [3, 4, 5]
    assert b["flag"].dtype == torch.bool and b["flag"].tolist() == [False, True, False]
    assert b["emb"].dtype == torch.float16 and b["emb"].shape == (3, 2, 3) and b["emb"][2].eq(5).all()
    assert b["mask"].dtype == torch.uint8 and b["mask"].tolist() == [
        [i + k for k in range(4)] for i in (3, 4, 5)
    ]
    assert [a.tolist() for a in b["ragged"]] == [list(range(i + 1)) for i in (3, 4, 5)]  # ragged: a list
    assert b["txt"] == ["caption 3", "caption 4", "caption 5"]
    assert b["raw"] == [bytes([i]) * 2000 for i in (3, 4, 5)]
    assert b["meta"] == [{"i": 3}, {"i": 4}, {"i": 5}]
    assert b["sometimes"] == [b"x", None, b"x"]  # None where a sample lacks the field


def test_collate_values_edge_cases():
    assert collate_values([2**64 - 1, 1]) == [2**64 - 1, 1]  # beyond int64: left as the values
    big = collate_values([np.uint64(2**63), np.uint64(1)])
    assert big == [np.uint64(2**63), np.uint64(1)]
    ids = collate_values([np.uint32(7), np.uint32(9)])
    assert ids.dtype == torch.int64 and ids.tolist() == [7, 9]
    assert collate_values([bytearray(b"a"), memoryview(b"b")]) == [b"a", b"b"]
    assert collate_values([1, "a"]) == [1, "a"]
    text = collate_values([np.array(["a"]), np.array(["b"])])  # not numbers: the arrays as they are
    assert isinstance(text, list) and [a.tolist() for a in text] == [["a"], ["b"]]


def test_the_manifest_is_found_through_a_subset_and_rebinding_resets_it(sources, tmp_path):
    ds = _open(sources, "hf", "arrow", tmp_path)
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1)
    assert dec.resolved_label_field == "cls"
    assert dec.for_dataset(torch.utils.data.Subset(ds, [0, 1])).resolved_label_field == "label"
    assert dec.for_dataset(list(range(3))).resolved_label_field == "cls"  # no manifest: the default again
    assert ImageDecode(backend="cpu", label_field="y").for_dataset(ds).resolved_label_field == "y"
    assert ImageDecode(backend="cpu", label_field=False).for_dataset(ds).resolved_label_field is None


@pytest.mark.parametrize("bad", [True, "", 3, b"cls"])
def test_a_bad_label_field_is_refused_at_construction(bad):
    with pytest.raises(
        ValueError, match=r"label_field must be a field name, None .* or False \(no labels\), got"
    ):
        ImageDecode(backend="cpu", label_field=bad)


def test_one_decoder_given_to_loaders_whose_labels_differ_is_refused(sources, tmp_path):
    """Both loaders run the one object: the second loader's binding used to relabel the first's
    batches (its samples then failed with "no label field 'cls'", the manifest's field ignored)."""
    hf = _open(sources, "hf", "arrow", tmp_path)  # class_field "label"
    mds = open_dataset(str(sources["mds"]))  # no class_field: "cls"
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1)
    train = stallfree.DataLoader(hf, batch_size=4, shuffle=False, num_workers=0, decode=dec)
    told = r"reads labels from 'label'.* this dataset's are in 'cls'.*its own ImageDecode"
    with pytest.raises(ValueError, match=told):
        stallfree.DataLoader(mds, batch_size=4, shuffle=False, num_workers=0, decode=dec)
    assert next(iter(train))["label"].tolist() == [0, 1, 2, 0]  # the first loader is untouched
    # the same field, or a named label_field, shares fine; for_dataset rebinds on purpose
    stallfree.DataLoader(torch.utils.data.Subset(hf, [0, 1]), batch_size=2, decode=dec)
    named = ImageDecode(train=False, size=16, backend="cpu", num_threads=1, label_field="label")
    stallfree.DataLoader(hf, batch_size=4, decode=named)
    stallfree.DataLoader(mds, batch_size=4, decode=named)
    assert dec.for_dataset(mds).resolved_label_field == "cls"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hugging_face_dataset_object_is_labelled_from_its_class_label_column(rows, workers):
    """A ``datasets.Dataset`` handed to the loader as it is: its ClassLabel column is the label
    (as ``stallfree shard`` would record it), other columns pass through; a PIL-decoding Image
    column is an error that says how to hand over the encoded bytes."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"image": datasets.Image(), "target": datasets.ClassLabel(names=NAMES), "id": datasets.Value("int64")}
    )
    table = {
        "image": [{"bytes": r["image"], "path": None} for r in rows],
        "target": [r["label"] for r in rows],
        "id": [r["id"] for r in rows],
    }
    hf = datasets.Dataset.from_dict(table, features=features)
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1)
    encoded = hf.cast_column("image", datasets.Image(decode=False))
    loader = stallfree.DataLoader(encoded, batch_size=4, shuffle=False, num_workers=workers, decode=dec)
    got = [(i, lab) for b in loader for i, lab in zip(b["id"].tolist(), b["label"].tolist(), strict=True)]
    assert got == [(r["id"], r["label"]) for r in rows]
    pil = stallfree.DataLoader(
        hf, batch_size=4, shuffle=False, num_workers=0, decode=ImageDecode(backend="cpu")
    )
    with pytest.raises(BatchDecodeError, match=r"cast_column\('image', datasets.Image\(decode=False\)\)"):
        next(iter(pil))

"""Hugging Face ``datasets`` data as users have it, built with the library itself: a
``save_to_disk`` directory, ``.arrow`` / ``.parquet`` files and ``Dataset`` / ``IterableDataset``
objects, with ``Image()``, ``Audio()`` and ``ClassLabel`` columns, sharded as rows and read back
through ``open_dataset``, ``stallfree.DataLoader`` and ``ImageDecode``."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.cli import main
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import SourceError, SourceReadError, open_source
from stallfree.testing.images import jpeg_bytes

datasets = pytest.importorskip("datasets")

N = 30
NAMES = ["car", "cat", "dog"]


def _features():
    return datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=NAMES),
            "caption": datasets.Value("string"),
        }
    )


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return jpeg_bytes(N, seed=5, sizes=((40, 32), (32, 40)))


@pytest.fixture(scope="module")
def hf(images):
    """Class-sorted rows (as the library's imagefolder loader produces them)."""
    labels = sorted(i % 3 for i in range(N))
    return datasets.Dataset.from_dict(
        {
            "image": [{"bytes": b, "path": f"img{i}.jpg"} for i, b in enumerate(images)],
            "label": labels,
            "caption": [f"a {NAMES[c]} number {i}" for i, c in enumerate(labels)],
        },
        features=_features(),
    )


@pytest.fixture(scope="module")
def saved(hf, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hfsrc") / "saved"
    hf.save_to_disk(str(root), max_shard_size="20KB")
    assert len(list(root.glob("*.arrow"))) > 1
    return root


def _tar_rows(root: Path) -> dict[str, dict[str, bytes]]:
    rows: dict[str, dict[str, bytes]] = {}
    for path in sorted(root.glob("*.tar")):
        with tarfile.open(path) as tf:
            for m in tf:
                key, _, field = m.name.partition(".")
                rows.setdefault(key, {})[field] = tf.extractfile(m).read()
    return rows


def test_class_sorted_rows_are_shuffled_unless_told_not_to(saved, tmp_path):
    """datasets' imagefolder loader writes one class after another: the same single-class
    shards as an ImageFolder source, so the same default."""
    assert open_source(str(saved)).grouped
    assert main(["shard", str(saved), str(tmp_path / "s"), "--max-samples", "10", "--no-progress"]) == 0
    assert (
        main(
            ["shard", str(saved), str(tmp_path / "n"), "--max-samples", "10", "--no-progress", "--no-shuffle"]
        )
        == 0
    )
    with tarfile.open(tmp_path / "s" / "shard-000000.tar") as tf:
        first = {tf.extractfile(m).read() for m in tf if m.name.endswith(".label")}
    assert len(first) > 1  # shard 0 holds more than one class
    assert list(_tar_rows(tmp_path / "n")) == [f"{i:09d}" for i in range(N)]
    assert json.loads((tmp_path / "n" / "manifest.json").read_text())["shuffle_seed"] is None


def test_save_to_disk_dir_shards_its_rows_not_its_files(saved, hf, images, tmp_path):
    """Issue 19.1: the directory sharded as 3 file-samples (.arrow + 2 JSON files), rc 0."""
    out = tmp_path / "out"
    assert main(["shard", str(saved), str(out), "--max-samples", "8", "--no-progress", "--json"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(s["samples"] for s in manifest["shards"]) == N
    assert manifest["classes"] == NAMES and manifest["class_field"] == "label"
    # class-sorted rows are sharded shuffled (seed 0), as an ImageFolder is (issue 19.4)
    assert manifest["shuffle_seed"] == 0
    rows = _tar_rows(out)
    assert sorted(rows) == [f"{i:09d}" for i in range(N)]
    for i in range(N):
        row = rows[f"{i:09d}"]
        assert row["image"] == images[i]  # the encoded JPEG, byte for byte, not a struct
        assert NAMES[int(row["label"])] == hf.features["label"].int2str(hf[i]["label"])
        assert row["caption"].decode() == hf[i]["caption"]


def test_hf_dataset_to_dataloader_every_row_once_labels_by_name(saved, hf, tmp_path):
    """Done-when: save_to_disk -> stallfree shard -> stallfree.DataLoader + ImageDecode."""
    from stallfree.gpu_decode.select import ImageDecode
    from stallfree.loader.dataloader import DataLoader

    out = tmp_path / "shards"
    assert main(["shard", str(saved), str(out), "--max-samples", "7", "--no-progress"]) == 0
    ds = open_dataset(str(out))
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1, label_field="label")
    loader = DataLoader(ds, batch_size=8, shuffle=True, seed=3, decode=dec)
    seen: dict[str, str] = {}
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 16, 16)
        for key, label in zip(batch["__key__"], batch["label"].tolist(), strict=True):
            assert key not in seen
            seen[key] = ds.manifest.classes[label]
    assert len(seen) == N
    assert seen == {f"{i:09d}": hf.features["label"].int2str(hf[i]["label"]) for i in range(N)}


def test_arrow_output_keeps_types_and_classes(saved, images, tmp_path):
    summary = shard_dataset(open_source(str(saved)), str(tmp_path / "a"), format="arrow", max_samples=11)
    assert summary.manifest.field_types["image"] == "binary"
    assert summary.manifest.classes == NAMES
    ds = open_dataset(str(tmp_path / "a"))
    assert {s["__key__"]: s["image"] for s in ds} == {f"{i:09d}": images[i] for i in range(N)}


def test_open_dataset_over_saved_dir_gives_image_bytes_for_imagedecode(saved, images):
    from stallfree.gpu_decode.select import ImageDecode

    ds = open_dataset(str(saved))
    assert ds.manifest.classes == NAMES
    assert [ds[i]["image"] for i in range(N)] == images
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1, label_field="label")
    out = dec.decode_batch([ds[0], ds[1]], seed=0)
    assert out["image"].shape == (2, 3, 16, 16)
    # A struct cell as the library hands it out (decode off) decodes the same.
    struct = {"__key__": "s", "image": {"bytes": images[0], "path": "img0.jpg"}, "label": 0}
    again = dec.decode_batch([struct], seed=0)
    assert (again["image"][0] == out["image"][0]).all()


def test_arrow_and_parquet_files_with_structs(hf, saved, images, tmp_path):
    """Issue 19.2: from .arrow a TypeError (bytes not JSON serialisable), from .parquet a member
    holding {"bytes": null, ...}."""
    hf.to_parquet(str(tmp_path / "export" / "train-00000-of-00001.parquet"), batch_size=7)
    for n, src in enumerate((str(saved / "*.arrow"), str(tmp_path / "export"))):
        out = tmp_path / f"out{n}"
        shard_dataset(open_source(src), str(out))
        rows = _tar_rows(out)
        assert [rows[f"{i:09d}"]["image"] for i in range(N)] == images, src


def _path_only_parquet(root: Path, paths: list[str], images: list[bytes]) -> Path:
    """A parquet table of path-only Image() cells (what datasets writes for local image files),
    with the files beside it under imgs/."""
    (root / "imgs").mkdir(parents=True)
    for i, data in enumerate(images[: len(paths)]):
        (root / "imgs" / f"{i}.jpg").write_bytes(data)
    features = _features()
    table = pa.table(
        {
            "image": [{"bytes": None, "path": p} for p in paths],
            "label": [0] * len(paths),
            "caption": ["x"] * len(paths),
        },
        schema=features.arrow_schema,
    )
    pq.write_table(table, root / "data.parquet")
    return root / "data.parquet"


def test_path_only_cells_are_read_inside_the_dataset(images, tmp_path):
    src = _path_only_parquet(tmp_path / "ds", ["imgs/0.jpg", "./imgs/1.jpg", "imgs/../imgs/2.jpg"], images)
    out = tmp_path / "out"
    shard_dataset(open_source(str(src)), str(out))
    rows = _tar_rows(out)
    assert [rows[f"{i:09d}"]["image"] for i in range(3)] == images[:3]
    ds = open_dataset(str(src))  # open_dataset resolves them the same way
    assert [ds[i]["image"] for i in range(3)] == images[:3]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("../secret.jpg", "points outside the dataset"),
        ("imgs/../../secret.jpg", "points outside the dataset"),
        ("/etc/hostname", "absolute media path"),
        ("link.jpg", "resolves outside the dataset"),
    ],
)
def test_media_paths_outside_the_dataset_are_refused(images, tmp_path, path, message):
    (tmp_path / "secret.jpg").write_bytes(b"not yours")
    root = tmp_path / "ds"
    src = _path_only_parquet(root, ["imgs/0.jpg", path], images)
    (root / "link.jpg").symlink_to(tmp_path / "secret.jpg")
    with pytest.raises(SourceReadError, match=message) as info:
        shard_dataset(open_source(str(src)), str(tmp_path / "out"))
    assert str(src) in str(info.value) and "row 1" in str(info.value)
    summary = shard_dataset(open_source(str(src), on_error="skip"), str(tmp_path / "skip"), on_error="skip")
    assert summary.samples == 1 and message in summary.skipped[0]["error"]
    assert b"not yours" not in b"".join(p.read_bytes() for p in (tmp_path / "skip").glob("*.tar"))
    from stallfree.errors import CorruptShardError

    ds = open_dataset(str(src))
    assert ds[0]["image"] == images[0]
    with pytest.raises(CorruptShardError, match=message):
        ds[1]


def test_audio_column_gives_the_encoded_file(tmp_path):
    features = datasets.Features({"audio": datasets.Audio(), "label": datasets.ClassLabel(names=["a", "b"])})
    wavs = [b"RIFF" + bytes([i]) * (20 + i) for i in range(4)]
    table = pa.table(
        {"audio": [{"bytes": w, "path": f"{i}.wav"} for i, w in enumerate(wavs)], "label": [0, 1, 0, 1]},
        schema=features.arrow_schema,
    )
    hfds = datasets.Dataset(table, info=datasets.DatasetInfo(features=features))  # no audio codec needed
    hfds.save_to_disk(str(tmp_path / "audio"))
    summary = shard_dataset(str(tmp_path / "audio"), str(tmp_path / "out"))
    rows = _tar_rows(tmp_path / "out")
    assert [rows[f"{i:09d}"]["audio"] for i in range(4)] == wavs
    assert summary.manifest.extra["shuffle_seed"] is None  # labels not class-sorted: order kept
    assert [k for k in rows] == [f"{i:09d}" for i in range(4)]


def test_dataset_and_iterable_dataset_objects(hf, images, tmp_path):
    view = hf.shuffle(seed=1).select(range(12))  # an indices mapping over the table
    summary = shard_dataset(view, str(tmp_path / "view"), max_samples=5)
    rows = _tar_rows(tmp_path / "view")
    assert [rows[f"{i:09d}"]["image"] for i in range(12)] == [
        view.with_format("arrow")[i]["image"][0]["bytes"].as_py() for i in range(12)
    ]
    assert summary.manifest.classes == NAMES
    summary = shard_dataset(hf.to_iterable_dataset(num_shards=3), str(tmp_path / "iter"), max_samples=9)
    rows = _tar_rows(tmp_path / "iter")
    assert sorted(r["image"] for r in rows.values()) == sorted(images)
    assert summary.manifest.classes == NAMES and summary.samples == N


def test_dataset_dict_dir_names_its_splits(hf, tmp_path):
    datasets.DatasetDict({"train": hf, "test": hf.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"DatasetDict with splits train, test: shard one split directory"):
        open_source(str(tmp_path / "dd"))
    assert main(["shard", str(tmp_path / "dd" / "test"), str(tmp_path / "o"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["classes"] == NAMES


def test_same_bytes_for_any_worker_count(saved, tmp_path):
    """Workers get the source by fork and read their own rows: the output is the same files."""
    for workers in (1, 2):
        shard_dataset(open_source(str(saved)), str(tmp_path / f"w{workers}"), max_samples=6, workers=workers)
    one, two = ({p.name: p.read_bytes() for p in (tmp_path / w).iterdir()} for w in ("w1", "w2"))
    assert len(one) > 3 and one == two


def test_path_only_cells_of_a_dataset_object_resolve_under_media_root(images, tmp_path):
    (tmp_path / "media" / "imgs").mkdir(parents=True)
    (tmp_path / "media" / "imgs" / "0.jpg").write_bytes(images[0])
    table = pa.table(
        {"image": [{"bytes": None, "path": "imgs/0.jpg"}], "label": [1], "caption": ["c"]},
        schema=_features().arrow_schema,
    )
    obj = datasets.Dataset(table, info=datasets.DatasetInfo(features=_features()))  # in memory: no files
    with pytest.raises(SourceReadError, match=r"no media_root to resolve it under"):
        shard_dataset(obj, str(tmp_path / "o1"))
    shard_dataset(open_source(obj, media_root=tmp_path / "media"), str(tmp_path / "o2"))
    assert _tar_rows(tmp_path / "o2")["000000000"]["image"] == images[0]


def test_lists_of_images_are_refused_up_front(images, tmp_path):
    features = datasets.Features(
        {"frames": datasets.Sequence(datasets.Image()), "label": datasets.Value("int64")}
    )
    hfds = datasets.Dataset.from_dict(
        {"frames": [[{"bytes": images[0], "path": None}, {"bytes": images[1], "path": None}]], "label": [0]},
        features=features,
    )
    hfds.save_to_disk(str(tmp_path / "frames"))
    with pytest.raises(
        SourceError, match=r"column\(s\) 'frames' hold Image\(\)/Audio\(\) cells inside a list"
    ):
        open_source(str(tmp_path / "frames"))
    with pytest.raises(SourceError, match="inside a list"):
        open_source(hfds)


def test_video_and_pdf_columns_share_the_media_storage(tmp_path):
    features = datasets.Features({"video": datasets.Video(), "doc": datasets.Pdf()})
    table = pa.table(
        {
            "video": [{"bytes": b"\x00\x00\x00\x18ftypmp42", "path": "a.mp4"}],
            "doc": [{"bytes": b"%PDF-1.4", "path": None}],
        },
        schema=features.arrow_schema,
    )
    shard_dataset(datasets.Dataset(table, info=datasets.DatasetInfo(features=features)), str(tmp_path / "o"))
    assert _tar_rows(tmp_path / "o")["000000000"] == {
        "video": b"\x00\x00\x00\x18ftypmp42",
        "doc": b"%PDF-1.4",
    }

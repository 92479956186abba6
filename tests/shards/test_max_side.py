"""``stallfree shard --max-side N``: large images come out with a long side of exactly N (aspect
kept, same format), small ones keep their bytes, the manifest records it, the shards are
byte-identical for any worker count, a bad image follows ``--on-error``, and ``--overwrite``
replaces a dataset with a downscaled one (or back) all or nothing.

Runs that are meant to fail go through the CLI in a subprocess with a timeout.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from stallfree.errors import ManifestError, SampleDecodeError
from stallfree.gpu_decode.downscale import Downscale, target_size
from stallfree.shards.manifest.model import Manifest
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.testing.images import base_photos, make_image

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300
N = 320

# file -> (source size, mode, encoder options); every image's sample key is "class/stem".
IMAGES: dict[str, tuple[tuple[int, int], str, dict]] = {
    "a/big_420.jpg": ((1024, 768), "RGB", {"quality": 90, "subsampling": 2}),
    "a/tall_444.jpg": ((768, 1024), "RGB", {"quality": 90, "subsampling": 0}),
    "a/grey.jpg": ((1000, 500), "L", {"quality": 85}),
    "a/small.jpg": ((300, 200), "RGB", {"quality": 90}),
    "a/edge.jpg": ((320, 240), "RGB", {"quality": 90}),  # long side == N: kept
    "b/palette.png": ((900, 500), "P", {}),
    "b/alpha.png": ((640, 400), "RGBA", {}),
    "b/small.png": ((100, 80), "RGB", {}),
}
# What each one becomes: (size, mode), or None for "original bytes".
EXPECTED: dict[str, tuple[tuple[int, int], str] | None] = {
    "a/big_420": ((320, 240), "RGB"),
    "a/tall_444": ((240, 320), "RGB"),
    "a/grey": ((320, 160), "L"),
    "a/small": None,
    "a/edge": None,
    "b/palette": ((320, 178), "RGB"),  # 500 * 320 / 900 = 177.8; palette widened to filter it
    "b/alpha": ((320, 200), "RGBA"),
    "b/small": None,
}


def cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys\nfrom stallfree.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT
    )


def encode(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


def write_images(root: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    photos = base_photos()
    for rel, (size, mode, options) in IMAGES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        img = make_image(rng, photos, size)
        if mode == "P":
            img = img.convert("P", palette=Image.Palette.ADAPTIVE)
        elif mode == "RGBA":
            img = img.convert("RGBA")
            img.putalpha(Image.linear_gradient("L").resize(size))
        elif mode != "RGB":
            img = img.convert(mode)
        path.write_bytes(encode(img, "JPEG" if rel.endswith(".jpg") else "PNG", **options))
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def image_field(sample: dict) -> tuple[str, bytes]:
    name = "jpg" if "jpg" in sample else "png"
    return name, bytes(sample[name])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("src") / "imf")


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> Path:
    """The clean images plus a truncated large JPEG and a file that is not an image at all."""
    root = write_images(tmp_path_factory.mktemp("bad") / "imf")
    whole = (root / "a/big_420.jpg").read_bytes()
    (root / "c").mkdir()
    (root / "c/truncated.jpg").write_bytes(whole[: len(whole) * 2 // 3])
    (root / "c/text.jpg").write_bytes(b"this is not a JPEG, only a text file with a .jpg name\n" * 4)
    return root


# -- the transform alone ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "size, expected",
    [
        ((1024, 768), (320, 240)),
        ((768, 1024), (240, 320)),
        ((900, 500), (320, 178)),
        ((641, 1), (320, 1)),  # the short side never rounds to 0
        ((1000, 3), (320, 1)),  # 0.96 rounds to 1
        ((1000, 5), (320, 2)),  # 1.6 rounds to 2
        ((640, 1), (320, 1)),  # 0.5 rounds half up
        ((500, 500), (320, 320)),
    ],
)
def test_target_size_keeps_the_aspect_with_a_long_side_of_n(size, expected) -> None:
    assert target_size(*size, N) == expected


def test_settings_are_checked() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_side"):
            Downscale(bad)
    for bad in (0, 101, True):
        with pytest.raises(ValueError, match="quality"):
            Downscale(N, bad)


def test_apply_changes_only_large_image_fields(folder: Path) -> None:
    big = (folder / "a/big_420.jpg").read_bytes()
    small = (folder / "a/small.jpg").read_bytes()
    sample = {"__key__": "k", "jpg": big, "png": small, "cls": 3, "json": b"{}", "txt": "x"}
    out, changed = Downscale(N).apply(sample)
    assert changed == 1
    assert Image.open(io.BytesIO(out["jpg"])).size == (320, 240)
    assert {k: v for k, v in out.items() if k != "jpg"} == {k: v for k, v in sample.items() if k != "jpg"}
    assert sample["jpg"] is big  # the input sample is not modified
    same, none = Downscale(N).apply({"__key__": "k", "jpg": small})
    assert none == 0 and same["jpg"] is small
    # A Hugging Face image struct keeps its other members.
    hf, changed = Downscale(N).apply({"__key__": "k", "image": {"bytes": big, "path": "x.jpg"}})
    assert changed == 1 and hf["image"]["path"] == "x.jpg"
    assert Image.open(io.BytesIO(hf["image"]["bytes"])).size == (320, 240)


def test_bad_and_over_limit_images_name_the_key_and_field(folder: Path, bad_folder: Path) -> None:
    truncated = (bad_folder / "c/truncated.jpg").read_bytes()
    with pytest.raises(SampleDecodeError, match=r"field 'jpg': truncated JPEG.*sample 'c/t'") as info:
        Downscale(N).apply({"__key__": "c/t", "jpg": truncated})
    assert info.value.key == "c/t"
    big = (folder / "a/big_420.jpg").read_bytes()
    with pytest.raises(SampleDecodeError, match=r"1024x768 = 786,432 pixels is over the limit of 100,000"):
        Downscale(N, max_pixels=100_000).apply({"__key__": "k", "jpg": big})
    gif = encode(Image.new("RGB", (400, 300)), "GIF")
    with pytest.raises(SampleDecodeError, match="cannot re-encode a gif image"):
        Downscale(N).apply({"__key__": "k", "image": gif})


def test_downscaled_pixels_match_a_full_decode_resampled(folder: Path) -> None:
    """The DCT-scaled decode plus Lanczos is close to resampling the full decode (no aliasing,
    no shift), and quality trades bytes as asked."""
    data = (folder / "a/big_420.jpg").read_bytes()
    ours = np.asarray(Image.open(io.BytesIO(Downscale(N, 95).image(data))), dtype=np.float32)
    reference = Image.open(io.BytesIO(data)).convert("RGB").resize((320, 240), Image.Resampling.LANCZOS)
    assert np.abs(ours - np.asarray(reference, dtype=np.float32)).mean() < 3.0
    assert len(Downscale(N, 50).image(data)) < len(Downscale(N, 95).image(data))


# -- through the sharder ----------------------------------------------------------------------------
def test_large_images_get_a_long_side_of_n_and_small_ones_keep_their_bytes(folder: Path, tmp_path: Path):
    summary = shard_dataset(
        open_source(folder), str(tmp_path / "out"), max_samples=3, transform=Downscale(N, 85)
    )
    samples = {s["__key__"]: s for s in open_dataset(str(tmp_path / "out"))}
    assert sorted(samples) == sorted(EXPECTED)
    for key, want in EXPECTED.items():
        name, data = image_field(samples[key])
        source = (folder / f"{key}.{name}").read_bytes()
        if want is None:
            assert data == source, key
            continue
        img = Image.open(io.BytesIO(data))
        assert (img.size, img.mode) == want, key
        assert img.format == ("JPEG" if name == "jpg" else "PNG"), key
    # JPEG chroma subsampling is kept (2 = 4:2:0, 0 = 4:4:4).
    for key, sampling in (("a/big_420", 2), ("a/tall_444", 0)):
        img = Image.open(io.BytesIO(bytes(samples[key]["jpg"])))
        assert JpegImagePlugin.get_sampling(img) == sampling
    record = {"max_side": N, "quality": 85, "resample": "lanczos", "resized": 5}
    assert summary.to_json()["transform"] == record
    assert json.loads((tmp_path / "out/manifest.json").read_text())["transform"] == record
    assert Manifest.load(str(tmp_path / "out")).transform == record


def test_arrow_shards_are_downscaled_too(folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(folder / "a", src / "a")  # one schema: JPEGs only
    shard_dataset(open_source(src), str(tmp_path / "out"), format="arrow", transform=Downscale(N))
    sizes = {
        s["__key__"]: Image.open(io.BytesIO(bytes(s["jpg"]))).size
        for s in open_dataset(str(tmp_path / "out"))
    }
    assert sizes == {
        "a/big_420": (320, 240),
        "a/tall_444": (240, 320),
        "a/grey": (320, 160),
        "a/small": (300, 200),
        "a/edge": (320, 240),
    }
    assert json.loads((tmp_path / "out/manifest.json").read_text())["transform"]["resized"] == 3


def test_shards_are_byte_identical_for_one_two_and_three_workers(folder: Path, tmp_path: Path) -> None:
    trees = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        shard_dataset(open_source(folder), str(out), max_samples=2, workers=workers, transform=Downscale(N))
        trees.append(tree(out))
    assert len([p for p in trees[0] if p.endswith(".tar")]) == 4
    assert trees[0] == trees[1] == trees[2]


def test_no_max_side_writes_no_transform_record(folder: Path, tmp_path: Path) -> None:
    summary = shard_dataset(open_source(folder), str(tmp_path / "out"))
    assert "transform" not in json.loads((tmp_path / "out/manifest.json").read_text())
    assert "transform" not in summary.to_json()


def test_manifest_transform_round_trips_and_is_validated() -> None:
    base = {"version": 1, "format": "tar", "fields": ["jpg"], "shards": []}
    record = {"max_side": 320, "quality": 90, "resample": "lanczos", "resized": 7}
    assert Manifest.from_json({**base, "transform": record}).to_json()["transform"] == record
    assert Manifest.from_json(base).transform is None
    for bad, message in (
        ([320], "'transform' must be an object or null"),
        ({"max_side": 0}, "transform max_side must be an integer >= 1: 0"),
        ({"max_side": "320"}, "transform max_side must be an integer >= 1: '320'"),
        ({"quality": 101}, "transform quality must be an integer from 1 to 100: 101"),
        ({"resized": -1}, "transform resized must be an integer >= 0: -1"),
        ({"resized": True}, "transform resized must be an integer >= 0: True"),
    ):
        with pytest.raises(ManifestError, match=message.replace("[", r"\[")):
            Manifest.from_json({**base, "transform": bad}, where="m.json")


# -- bad images and the error policy ----------------------------------------------------------------
def test_a_bad_image_stops_the_run_under_raise(bad_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = cli(
        "shard",
        str(bad_folder),
        str(out),
        "--max-side",
        str(N),
        "--no-progress",
        "--workers",
        "2",
        "--no-shuffle",
    )
    assert res.returncode == 1
    # One shard, read in order (--no-shuffle): c/text is the first bad sample.
    assert "field 'jpg': not a recognised image format" in res.stderr
    assert "sample 'c/text'" in res.stderr
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_images_are_skipped_counted_and_named_under_skip(
    bad_folder: Path, tmp_path: Path, workers: str
) -> None:
    out = tmp_path / "out"
    res = cli(
        "shard",
        str(bad_folder),
        str(out),
        "--max-side",
        str(N),
        "--on-error",
        "skip",
        "--max-samples",
        "3",
        "--workers",
        workers,
        "--no-progress",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["samples"] == len(EXPECTED)
    assert info["transform"] == {"max_side": N, "quality": 90, "resample": "lanczos", "resized": 5}
    skipped = sorted(info["skipped"], key=lambda s: s["source"])
    assert [s["source"] for s in skipped] == [
        str(bad_folder / "c/text.jpg"),
        str(bad_folder / "c/truncated.jpg"),
    ]
    assert "field 'jpg': not a recognised image format" in skipped[0]["error"]
    assert "sample 'c/text'" in skipped[0]["error"]
    assert "field 'jpg': truncated JPEG: no end-of-image marker" in skipped[1]["error"]
    assert "sample 'c/truncated'" in skipped[1]["error"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["skipped"], key=lambda s: s["source"]) == skipped
    assert {s["__key__"] for s in open_dataset(str(out))} == set(EXPECTED)


# -- with --overwrite ---------------------------------------------------------------------------------
def test_overwrite_with_max_side_replaces_the_dataset_and_back(folder: Path, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    common = ("--max-samples", "3", "--no-progress")
    assert cli("shard", str(folder), str(ds), *common).returncode == 0
    original = tree(ds)

    res = cli("shard", str(folder), str(ds), "--max-side", str(N), "--overwrite", "--workers", "2", *common)
    assert res.returncode == 0, res.stderr
    assert "resized 5 image(s) to a long side of 320 px (quality 90)" in res.stdout
    manifest = json.loads((ds / "manifest.json").read_text())
    assert manifest["transform"]["resized"] == 5
    assert set(tree(ds)).isdisjoint(p for p in original if p != "manifest.json")  # old shards removed
    samples = {s["__key__"]: s for s in open_dataset(str(ds))}
    assert Image.open(io.BytesIO(bytes(samples["a/big_420"]["jpg"]))).size == (320, 240)
    assert cli("verify", str(ds)).returncode == 0

    res = cli("shard", str(folder), str(ds), "--overwrite", *common)
    assert res.returncode == 0, res.stderr
    assert "transform" not in json.loads((ds / "manifest.json").read_text())
    samples = {s["__key__"]: s for s in open_dataset(str(ds))}
    assert bytes(samples["a/big_420"]["jpg"]) == (folder / "a/big_420.jpg").read_bytes()


def test_failed_overwrite_with_max_side_keeps_the_old_dataset(
    folder: Path, bad_folder: Path, tmp_path: Path
) -> None:
    ds = tmp_path / "ds"
    assert cli("shard", str(folder), str(ds), "--max-samples", "3", "--no-progress").returncode == 0
    before = tree(ds)
    res = cli(
        "shard",
        str(bad_folder),
        str(ds),
        "--max-side",
        str(N),
        "--overwrite",
        "--max-samples",
        "3",
        "--workers",
        "2",
        "--no-progress",
    )
    assert res.returncode == 1
    assert "sample 'c/t" in res.stderr
    assert tree(ds) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (("--quality", "80"), "--quality applies only with --max-side"),
        (("--max-side", "0"), "--max-side must be a positive number of pixels, got 0"),
        (("--max-side", "320", "--quality", "0"), "--quality must be from 1 to 100, got 0"),
        (("--max-side", "320", "--quality", "101"), "--quality must be from 1 to 100, got 101"),
        (("--max-side", "320", "--tokenizer", "t.json"), "--max-side applies to image shards"),
    ],
)
def test_bad_flags_are_usage_errors(folder: Path, tmp_path: Path, args, message) -> None:
    res = cli("shard", str(folder), str(tmp_path / "out"), "--no-progress", *args)
    assert res.returncode == 2
    assert message in res.stderr
    assert not (tmp_path / "out").exists()

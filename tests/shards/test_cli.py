"""The shard / index / inspect / verify commands: exit codes, --json output, summaries, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.cli import main
from stallfree.testing.images import make_image_folder

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    """Run ``python -m stallfree ARGS`` as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "stallfree", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(
        tmp_path_factory.mktemp("cli") / "imf", classes=3, per_class=4, sizes=((48, 40),)
    )


@pytest.fixture(scope="module")
def sharded(folder: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli-out") / "ds"
    # --no-shuffle: the tests below read the shards back in source (class) order
    assert (
        main(
            ["shard", str(folder), str(out), "--max-samples", "5", "--no-shuffle", "--no-progress", "--json"]
        )
        == 0
    )
    return out


def test_shard_json_summary_and_progress(folder: Path, tmp_path: Path) -> None:
    res = cli("shard", str(folder), str(tmp_path / "out"), "--workers", "2", "--max-bytes", "20KB", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["samples"] == 12 and summary["format"] == "tar" and summary["skipped"] == []
    assert summary["shards"] == len(list((tmp_path / "out").glob("*.tar"))) > 1
    assert summary["bytes"] == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.tar"))
    assert "sharding" in res.stderr and "planned 12 samples" in res.stderr


def test_shard_output_read_by_webdataset_and_open_dataset(folder: Path, sharded: Path) -> None:
    import webdataset as wds

    from stallfree.shards.open import open_dataset

    files = [p for c in sorted(folder.iterdir()) for p in sorted(c.iterdir())]
    urls = [str(p) for p in sorted(sharded.glob("*.tar"))]
    back = list(wds.WebDataset(urls, shardshuffle=False))
    assert [s["jpg"] for s in back] == [p.read_bytes() for p in files]
    assert [int(s["cls"]) for s in back] == [0] * 4 + [1] * 4 + [2] * 4
    ds = open_dataset(str(sharded))
    assert (
        len(ds) == 12
        and ds[7]["jpg"] == files[7].read_bytes()
        and ds[7]["__key__"] == "class_01/img_01_00003"
    )


def test_shard_text_summary_lists_skipped_and_raise_names_file(tmp_path: Path) -> None:
    src = tmp_path / "imf"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "ok.jpg").write_bytes(b"fine")
    os.symlink(tmp_path / "missing.jpg", src / "cat" / "broken.jpg")
    res = cli("shard", str(src), str(tmp_path / "out"), "--on-error", "skip", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "wrote 1 samples in 1 tar shard(s)" in res.stdout
    assert (
        "skipped 1 unreadable source item(s)" in res.stdout and str(src / "cat" / "broken.jpg") in res.stdout
    )
    res = cli("shard", str(src), str(tmp_path / "out2"), "--no-progress")
    assert res.returncode == 1
    assert f"cannot read source file {src / 'cat' / 'broken.jpg'}" in res.stderr
    assert not (tmp_path / "out2" / "manifest.json").exists()


def test_shard_bad_arguments(folder: Path, tmp_path: Path, capsys) -> None:
    assert main(["shard", str(folder), str(tmp_path / "o"), "--max-bytes", "lots"]) == 2
    assert "not a size: 'lots'" in capsys.readouterr().err
    assert main(["shard", str(folder), str(tmp_path / "o"), "--workers", "0"]) == 2
    assert main(["shard", str(tmp_path / "nothing"), str(tmp_path / "o"), "--no-progress"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_shard_refuses_existing_dataset_unless_overwrite(folder: Path, sharded: Path, capsys) -> None:
    assert main(["shard", str(folder), str(sharded), "--no-progress"]) == 1
    assert "already holds a dataset" in capsys.readouterr().err


def test_parquet_to_arrow_and_inspect_json(tmp_path: Path, capsys) -> None:
    table = pa.table(
        {"ids": pa.array([[1, 2], [3]], pa.list_(pa.int64())), "label": pa.array([5, 6], pa.int8())}
    )
    pq.write_table(table, tmp_path / "t.parquet")
    assert (
        main(
            [
                "shard",
                str(tmp_path / "t.parquet"),
                str(tmp_path / "out"),
                "--format",
                "arrow",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "arrow" and info["samples"] == 2 and info["shards"] == 1
    assert info["field_types"] == {"ids": "list<element: int64>", "label": "int8"}
    assert info["first_sample"] == {
        "key": "000000000",
        "field_sizes": {"ids": "array[2] int64", "label": "int"},
    }


def test_inspect_text_and_json(sharded: Path, folder: Path) -> None:
    res = cli("inspect", str(sharded), "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert (info["format"], info["samples"], info["shards"]) == ("tar", 12, 3)
    assert info["classes"] == ["class_00", "class_01", "class_02"] and info["fields"] == ["cls", "jpg"]
    first = folder / "class_00" / "img_00_00000.jpg"
    assert info["first_sample"] == {
        "key": "class_00/img_00_00000",
        "field_sizes": {"cls": 1, "jpg": first.stat().st_size},
    }
    res = cli("inspect", str(sharded))
    assert res.returncode == 0 and "samples:     12 in 3 shard(s)" in res.stdout
    assert cli("inspect", str(sharded.parent / "nope")).returncode == 1


def test_verify_exit_codes_and_problem_list(sharded: Path, tmp_path: Path, capsys) -> None:
    assert main(["verify", str(sharded), "--decode", "--no-progress"]) == 0
    assert "checked 3 shard(s), 12 samples" in capsys.readouterr().out
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in sharded.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    data = bytearray((broken / "shard-000001.tar").read_bytes())
    data[3000] ^= 1
    (broken / "shard-000001.tar").write_bytes(bytes(data))
    (broken / "shard-000002.tar").unlink()
    res = cli("verify", str(broken), "--no-progress")
    assert res.returncode == 1
    assert "2 problem(s)" in res.stdout
    assert "HashMismatchError: shard shard-000001.tar" in res.stdout
    assert "MissingShardError: shard shard-000002.tar" in res.stdout
    res = cli("verify", str(broken), "--json", "--no-progress")
    report = json.loads(res.stdout)
    assert res.returncode == 1 and report["ok"] is False
    assert [p["error"] for p in report["problems"]] == ["HashMismatchError", "MissingShardError"]


def test_verify_of_a_tar_file_is_one_error_line(sharded: Path, tmp_path: Path) -> None:
    """A shard file, whole or cut, is not a dataset: one error line and exit 1, no traceback."""
    tar = sharded / "shard-000000.tar"
    res = cli("verify", str(tar), "--no-progress")
    assert (res.returncode, res.stdout) == (1, "")
    assert res.stderr.splitlines() == [
        f"stallfree verify: error: {tar} names shard files, not a dataset: verify checks a dataset directory "
        f"(or its manifest.json) against the manifest; pass its dataset directory file://{sharded} "
        "(shard shard-000000.tar)"
    ]
    cut = tmp_path / "cut.tar"
    cut.write_bytes(tar.read_bytes()[:700])
    res = cli("verify", str(cut), "--no-progress")
    assert (res.returncode, res.stdout) == (1, "")
    assert res.stderr.splitlines() == [
        f"stallfree verify: error: {cut} names shard files, not a dataset: verify checks a dataset directory "
        f"(or its manifest.json) against the manifest; write a manifest for plain tars with "
        f"`stallfree index {cut}` (shard cut.tar)"
    ]
    res = cli("verify", str(tmp_path / "*.tar"), "--no-progress")
    assert (
        res.returncode == 1
        and res.stderr.startswith("stallfree verify: error: ")
        and "Traceback" not in res.stderr
    )


def test_index_existing_webdataset_tars(tmp_path: Path, capsys) -> None:
    import webdataset as wds

    from stallfree.shards.open import open_dataset

    for part in range(2):
        with wds.TarWriter(str(tmp_path / f"p{part}.tar")) as w:
            for i in range(3):
                w.write({"__key__": f"k{part}{i}", "txt": f"text {part}{i}", "cls": i})
    tars = [str(p) for p in sorted(tmp_path.glob("*.tar"))]
    assert main(["inspect", str(tmp_path), "--json"]) == 0  # no manifest yet: indexed on the fly
    info = json.loads(capsys.readouterr().out)
    assert (info["samples"], info["shards"], info["first_sample"]["key"]) == (6, 2, "k00")
    assert main(["index", *tars, "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == 6 and summary["shards"] == 2 and sorted(summary["fields"]) == ["cls", "txt"]
    assert (tmp_path / "p0.idx").read_text().startswith("v1.2 3\n")
    assert main(["verify", str(tmp_path), "--no-progress"]) == 0
    ds = open_dataset(str(tmp_path))
    assert [ds[i]["txt"] for i in range(6)] == [f"text {p}{i}".encode() for p in range(2) for i in range(3)]
    assert main(["index", str(tmp_path), "--no-progress"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["index", str(tmp_path), "--overwrite", "--no-progress"]) == 0


@pytest.mark.parametrize("command", ["shard", "index", "inspect", "verify"])
def test_help_has_an_example(command: str) -> None:
    res = cli(command, "--help")
    assert res.returncode == 0 and "example" in res.stdout and f"stallfree {command}" in res.stdout


def test_shard_output_read_by_dali_with_our_idx(folder: Path, sharded: Path) -> None:
    pytest.importorskip("nvidia.dali")
    import numpy as np
    from nvidia.dali import fn, pipeline_def

    files = [p for c in sorted(folder.iterdir()) for p in sorted(c.iterdir())]
    paths = [str(p) for p in sorted(sharded.glob("*.tar"))]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe():
        return tuple(
            fn.readers.webdataset(
                paths=paths,
                index_paths=[p[: -len(".tar")] + ".idx" for p in paths],
                ext=["jpg", "cls"],
                missing_component_behavior="error",
                random_shuffle=False,
                name="reader",
            )
        )

    p = pipe()
    p.build()
    assert p.epoch_size("reader") == 12
    got = []
    for _ in range(12):
        jpg, cls = p.run()
        got.append((np.array(jpg[0]).tobytes(), np.array(cls[0]).tobytes()))
    assert got == [(f.read_bytes(), str(i // 4).encode()) for i, f in enumerate(files)]

"""MLPerf Storage's accelerator utilisation: the arithmetic, the workload values, the N search,
the data generator and the table (harness/workload/au.py, workloads.py, workload_data.py, au_report.py)."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from stallfree.harness.workload import data as workload_data
from stallfree.harness.workload.au import JobAU, NSearch, job_au, rank_au
from stallfree.harness.workload.configs import ACCELERATORS, WORKLOAD_NAMES, workload
from stallfree.harness.workload.report import format_au_table


def test_rank_au_counts_the_configured_compute_not_the_measured_sleep():
    # 10 steps of 0.224 s configured compute in 2.8 s of wall time: 2.24 / 2.8
    assert rank_au(10, 0.224, 2.8) == pytest.approx(0.8)
    assert rank_au(10, 0.224, 2.24) == pytest.approx(1.0)
    assert rank_au(10, 0.224, 2.0) == 1.0  # a wall shorter than the compute (clock skew) caps at 1
    assert rank_au(3, 0.1, 0.0) == 0.0
    with pytest.raises(ValueError, match="must be >= 0"):
        rank_au(-1, 0.1, 1.0)


def test_job_au_is_the_mean_over_ranks_and_names_the_worst():
    ranks = [{"steps": 8, "wall_s": 2.0}, {"steps": 8, "wall_s": 4.0}]
    au = job_au(ranks, 0.25)  # 2.0 / 2.0 and 2.0 / 4.0
    assert au.ranks == (1.0, 0.5)
    assert au.mean == pytest.approx(0.75) and au.worst == 0.5
    assert au.meets(0.75) and not au.meets(0.76)
    assert JobAU(()).mean == 0.0
    with pytest.raises(ValueError, match="at least one rank"):
        job_au([], 0.1)


@pytest.mark.parametrize(
    ("name", "accelerator", "batch", "record", "stdev", "compute", "threshold"),
    [
        ("resnet50", "h100", 400, 114660.07, 0.0, 0.224, 0.90),
        ("resnet50", "a100", 400, 114660.07, 0.0, 0.435, 0.90),
        ("unet3d", "h100", 7, 146600628, 68341808, 0.323, 0.90),
        ("unet3d", "a100", 7, 146600628, 68341808, 0.636, 0.90),
        ("unet3d", "b200", 7, 146600628, 68341808, 0.162, 0.90),
        ("cosmoflow", "h100", 1, 2828486, 71311, 0.00350, 0.70),
        ("cosmoflow", "a100", 1, 2828486, 71311, 0.00551, 0.70),
    ],
)
def test_workload_values_are_the_dlio_configs(name, accelerator, batch, record, stdev, compute, threshold):
    wl = workload(name, accelerator)
    assert (wl.batch_size, wl.record_bytes, wl.record_stdev_bytes) == (batch, record, stdev)
    assert (wl.compute_s, wl.au_threshold) == (compute, threshold)
    assert wl.config == f"mlcommons/storage configs/dlio/workload/{name}_{accelerator}.yaml"
    assert not wl.derived and wl.scale == 1


def test_b200_without_a_config_is_derived_and_says_so():
    for name in ("resnet50", "cosmoflow"):
        wl = workload(name, "b200")
        assert wl.compute_s == workload(name, "h100").compute_s / 2
        assert "unet3d_b200.yaml" in wl.derived and wl.config.endswith(f"{name}_h100.yaml")
    assert {(n, a) for n in WORKLOAD_NAMES for a in ACCELERATORS} == {
        (workload(n, a).name, workload(n, a).accelerator) for n in WORKLOAD_NAMES for a in ACCELERATORS
    }


def test_scaling_divides_record_sizes_and_keeps_batch_and_compute():
    wl = workload("unet3d", "h100").scaled(64)
    assert wl.record_bytes == 146600628 / 64 and wl.record_stdev_bytes == 68341808 / 64
    assert (wl.batch_size, wl.compute_s, wl.scale) == (7, 0.323, 64)
    assert wl.bytes_per_s == pytest.approx(7 / 0.323 * 146600628 / 64)
    assert wl.scaled(2).scale == 128
    assert wl.steps_for(2.0) == 8 and workload("cosmoflow").steps_for(2.0) == 572
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="--scale"):
            wl.scaled(bad)


def test_unknown_workload_or_accelerator_names_the_flag():
    with pytest.raises(ValueError, match="--workload must be one of resnet50, unet3d, cosmoflow"):
        workload("bert")
    with pytest.raises(ValueError, match="--accelerator must be one of h100, a100, b200"):
        workload("unet3d", "v100")


def _search(threshold: float, max_n: int, au_of) -> tuple[NSearch, list[int]]:
    search, order = NSearch(threshold, max_n), []
    while (n := search.next_n()) is not None:
        order.append(n)
        search.record(n, au_of(n))
    return search, order


def test_search_doubles_then_bisects_to_the_largest_passing_n():
    search, order = _search(0.9, 16, lambda n: 0.99 if n <= 5 else 0.5)
    assert order == [1, 2, 4, 8, 6, 5]
    assert search.result == 5 and not search.capped


def test_search_stops_at_the_cap_and_says_it_may_keep_more():
    search, order = _search(0.9, 6, lambda n: 0.95)
    assert order == [1, 2, 4, 6]
    assert search.result == 6 and search.capped


def test_search_when_even_one_accelerator_misses():
    search, order = _search(0.7, 8, lambda n: 0.69)
    assert order == [1] and search.result == 0 and not search.capped


def test_search_at_exactly_the_threshold_passes():
    search, _ = _search(0.9, 4, lambda n: 0.9 if n <= 3 else 0.89)
    assert search.result == 3


def test_search_refuses_bad_bounds():
    with pytest.raises(ValueError, match="--max-accelerators"):
        NSearch(0.9, 0)
    with pytest.raises(ValueError, match="threshold"):
        NSearch(1.5, 4)
    with pytest.raises(ValueError, match="outside 1..4"):
        NSearch(0.9, 4).record(5, 1.0)


def test_data_is_written_in_both_layouts_with_the_workload_sizes_and_reused(tmp_path):
    wl = workload("unet3d").scaled(4096)  # ~36 KB volumes
    data = workload_data.prepare(tmp_path / "d", wl, 12, seed=3)
    files = sorted(data.files.iterdir())
    assert [p.name for p in files] == [f"{i:08d}.npz" for i in range(12)]
    from stallfree import open_dataset

    ds = open_dataset(str(data.shards))
    assert len(ds) == 12
    sizes = workload_data.record_sizes(wl, 12, 3)
    for i, path in enumerate(files):
        sample = ds[i]
        assert sample["npz"] == path.read_bytes()  # the same record in both layouts
        with zipfile.ZipFile(io.BytesIO(sample["npz"])) as z:
            assert z.namelist() == ["x.npy"]
        x = np.load(io.BytesIO(sample["npz"]), allow_pickle=False)["x"]
        assert x.dtype == np.uint8 and abs(len(sample["npz"]) - sizes[i]) < 400
    assert data.mean_bytes == pytest.approx(sum(len(p.read_bytes()) for p in files) / 12)
    stamp = {p: p.stat().st_mtime_ns for p in data.root.rglob("*") if p.is_file()}
    again = workload_data.prepare(tmp_path / "d", wl, 12, seed=3)
    assert again.record == data.record
    assert {p: p.stat().st_mtime_ns for p in data.root.rglob("*") if p.is_file()} == stamp
    other = workload_data.prepare(tmp_path / "d", wl, 10, seed=3)  # another request: rewritten
    assert other.samples == 10 and len(list(other.files.iterdir())) == 10
    assert json.loads((tmp_path / "d" / "workload.json").read_text())["samples"] == 10


def test_record_sizes_follow_the_config_mean_and_deviation_clipped():
    wl = workload("unet3d").scaled(64)
    sizes = np.array(workload_data.record_sizes(wl, 4000, 0))
    assert sizes.mean() == pytest.approx(wl.record_bytes, rel=0.03)
    assert sizes.std() == pytest.approx(wl.record_stdev_bytes, rel=0.08)
    assert sizes.min() >= round(wl.record_bytes / 10) and sizes.max() <= round(
        wl.record_bytes + 3 * wl.record_stdev_bytes
    )
    assert set(workload_data.record_sizes(workload("resnet50"), 5, 0)) == {114660}


def test_data_refuses_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not workload data"):
        workload_data.prepare(tmp_path, workload("cosmoflow").scaled(64), 4)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_table_gives_the_max_per_loader_and_au_per_n():
    wl = workload("unet3d").scaled(64)
    probe = {"au": 0.95, "mb_per_s": 98.0}
    report = {
        "workload": wl.as_dict(),
        "loaders": {
            "stallfree": {
                "max_accelerators": 4,
                "capped": True,
                "real_equivalent": 4 / 64,
                "probes": [{**probe, "n": 2}, {**probe, "n": 4, "au": 0.91}],
            },
            "torch": {
                "max_accelerators": 0,
                "capped": False,
                "real_equivalent": 0.0,
                "probes": [{**probe, "n": 1, "au": 0.42}],
            },
        },
        "skipped": {"dali": "nvidia.dali is not installed"},
    }
    table = format_au_table(report)
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line[:1].isalpha()}
    assert rows["stallfree"][1:6] == ["4+", "0.0625", "98", "91.0%", "2:95%"]
    assert rows["torch"][1:] == ["0", "0", "-", "-", "1:42%"]
    assert "dali: skipped (nvidia.dali is not installed)" in table
    assert "unet3d_h100.yaml" in table and "AU threshold 90%" in table and "1/64" in table


def test_cli_refuses_bad_workload_settings_before_running(tmp_path, capsys):
    from stallfree.cli import main

    assert main(["bench", str(tmp_path / "d"), "--workload", "unet3d", "--scale", "0"]) == 2
    assert "--scale must be a whole number >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "d"), "--workload", "unet3d", "--max-accelerators", "0"]) == 2
    assert "--max-accelerators must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # nothing written for a run that cannot start
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["bench", str(tmp_path / "mine"), "--workload", "cosmoflow", "--loader", "torch"]) == 2
    assert "holds no workload.json: not workload data" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]

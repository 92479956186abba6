"""benchmarks/bench_peers.py: its data set cache, label parsing, CPU accounting, ratios, and a
smoke run of every runner this environment can import (torchvision's runners are skipped, and
say so, in the library's .venv, which has no torchvision)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_peers  # noqa: E402
import peers_data  # noqa: E402


def test_dali_ascii_labels_parse_to_int64():
    raw = torch.tensor([[49, 50, 0], [55, 0, 0], [48, 0, 0], [49, 48, 51]], dtype=torch.uint8)
    labels = bench_peers._ascii_labels(raw)
    assert labels.dtype == torch.int64 and labels.tolist() == [12, 7, 0, 103]


def test_rrc_box_draws_within_the_scale_and_ratio_and_falls_back_to_the_centre():
    import math
    import random

    rng = random.Random(5)
    boxes = [bench_peers.rrc_box(500, 375, rng) for _ in range(2000)]
    for x, y, w, h in boxes:
        assert 0 <= x and x + w <= 500 and 0 <= y and y + h <= 375 and w > 0 and h > 0
        # rounding w and h moves area and ratio a little past the drawn ones
        assert 0.08 * 0.97 <= w * h / (500 * 375) <= 1.0
        assert 3 / 4 * 0.97 <= w / h <= 4 / 3 * 1.03
    areas = [w * h / (500 * 375) for _, _, w, h in boxes]
    assert min(areas) < 0.15 and max(areas) > 0.8  # the whole range is drawn, not one size
    assert len({b[:2] for b in boxes}) > 1000  # positions vary
    again = random.Random(5)
    assert [bench_peers.rrc_box(500, 375, again) for _ in range(5)] == boxes[:5]  # seeded
    # a strip no box of ratio 3/4..4/3 fits ten times running: the centre crop at the nearest ratio
    x, y, w, h = bench_peers.rrc_box(1000, 10, random.Random(0))
    assert (w, h) == (13, 10) and x == (1000 - 13) // 2 and y == 0
    assert math.isclose(w / h, 4 / 3, rel_tol=0.05)


def test_tree_cpu_counts_a_child_that_already_exited():
    burn = "import time\nwhile time.process_time() < 0.3: pass\n"
    before = bench_peers.tree_cpu_seconds()
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=60)
    assert bench_peers.tree_cpu_seconds() - before >= 0.28  # the child's 0.3 s, to clock-tick rounding


def _row(name: str, peer: bool, counted: bool = True) -> bench_peers.Runner:
    return bench_peers.Runner(name, name, peer, counted, bench_peers.ours_cpu)


def test_ratios_are_against_the_best_peer_on_each_measure():
    runners = [_row("a", True), _row("b", True), _row("ours", False), _row("f32", False, counted=False)]
    m = {
        "a": {"img_s": 100.0, "cpu_ms_img": 4.0, "first_s": 2.0, "peak_pss_mib": 900.0},
        "b": {"img_s": 200.0, "cpu_ms_img": 5.0, "first_s": 1.0, "peak_pss_mib": 1000.0},
        "ours": {"img_s": 300.0, "cpu_ms_img": 2.0, "first_s": 4.0, "peak_pss_mib": 1800.0},
        "f32": {"img_s": 150.0, "cpu_ms_img": 8.0, "first_s": 1.0, "peak_pss_mib": 900.0},
    }
    rounds = []
    for k in (1.0, 3.0, 2.0):  # medians: the k=2 round, i.e. m's figures times 2 for img/s
        rounds.append(
            {n: {**v, "img_s": v["img_s"] * k, "cores": 1.0, "output": "uint8"} for n, v in m.items()}
        )
    rows = {r["runner"]: r for r in bench_peers.summarise(rounds, runners)}
    assert rows["ours"]["img_s"] == 600.0
    assert rows["ours"]["x_img_s"] == 1.5  # 600 / best peer's 400
    assert rows["ours"]["x_cpu_ms_img"] == 2.0  # best peer 4.0 / 2.0
    assert rows["ours"]["x_first_s"] == 0.25  # best peer 1.0 / 4.0
    assert rows["ours"]["x_peak_pss_mib"] == 0.5  # best peer 900 / 1800
    assert rows["b"]["x_img_s"] == 1.0 and rows["a"]["x_cpu_ms_img"] == 1.0
    assert bench_peers.verdict(list(rows.values())) == [
        "ours: 1.50x best peer img/s, 2.00x CPU/img -> meets the 1.3x bar",
        "f32: 0.75x best peer's uint8 img/s -> below the 1.0x bar",
    ]
    table = bench_peers.markdown(list(rows.values()))
    assert table.splitlines()[0].count("x best peer") == 4 and len(table.splitlines()) == 6


def test_data_set_is_written_once_and_reused(tmp_path):
    root = tmp_path / "data"
    data = peers_data.prepare(root, 12, classes=3, seed=1, workers=1)
    assert data.stats["images"] == 12 and len(list(data.folder.rglob("*.jpg"))) == 12
    manifest = json.loads((data.shards / "manifest.json").read_text())
    assert sum(s["samples"] for s in manifest["shards"]) == 12
    assert data.tars and all(Path(p).exists() for p in data.idxs)
    stamp = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    again = peers_data.prepare(root, 12, classes=3, seed=1, workers=1)
    assert again.stats == data.stats
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == stamp
    bigger = peers_data.prepare(root, 15, classes=3, seed=1, workers=1)  # a different set: rewritten
    assert bigger.stats["images"] == 15 and len(list(bigger.folder.rglob("*.jpg"))) == 15


def test_data_set_refuses_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a bench_peers data set"):
        peers_data.prepare(tmp_path, 12)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


@pytest.mark.slow
def test_smoke_run_of_every_importable_runner(tmp_path):
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--smoke"]
    cmd += ["--dir", str(tmp_path / "data"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ran = {r["runner"]: r for r in report["summary"]}
    expect = {"ours-cpu", "ours-auto", "ours-float32"}
    if importlib.util.find_spec("nvidia") and importlib.util.find_spec("nvidia.dali"):
        expect |= {"dali", "dali-tuned"}
    if importlib.util.find_spec("torchvision"):
        expect |= {"torch-pil"} | ({"torch-simplejpeg"} if importlib.util.find_spec("simplejpeg") else set())
        if importlib.util.find_spec("spdl"):
            expect |= {"spdl"}
        if importlib.util.find_spec("torchdata") and importlib.util.find_spec("simplejpeg"):
            expect |= {"tdn-process", "tdn-thread"}
    else:
        assert {"torch-pil", "torch-simplejpeg", "spdl", "tdn-process", "tdn-thread"} <= set(
            report["skipped"]
        )
    assert set(ran) == expect
    for name, row in ran.items():
        fallback = name.startswith("ours") and bool(report["notes"])  # no uint8 ImageDecode yet
        want = "float32" if name == "ours-float32" or fallback else "uint8"
        assert row["output"] == f"{want} (16, 3, 224, 224)", (name, row["output"])
        # two prefetched batches can take less than a clock tick of CPU: only the sign is sure
        assert row["rounds"] == 1 and row["img_s"] > 0 and row["cpu_ms_img"] >= 0
    assert report["data"]["images"] == 96

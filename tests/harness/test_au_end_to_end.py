"""``stallfree bench --workload resnet50`` end to end, in a subprocess with a timeout: the data is
written in both layouts, every loader this environment has reads it, the report adds up. The
subprocess is ``python -m stallfree`` forked from the test zygote (``tests/zygote.py``)."""

from __future__ import annotations

import json

import pytest

from stallfree.harness.loaders import loader_available
from tests.zygote import AS_MODULE, run_python

LOADERS = [name for name in ("stallfree", "torch", "webdataset", "dali") if loader_available(name) is None]


@pytest.mark.slow
def test_workload_bench_end_to_end(tmp_path):
    out, png = tmp_path / "au.json", tmp_path / "au.png"
    cmd = ["stallfree", "bench", str(tmp_path / "data"), "--workload", "resnet50"]
    cmd += ["--scale", "64", "--samples", "400", "--max-accelerators", "1", "--steps", "2", "--warmup", "1"]
    cmd += ["--workers", "1", "--loader", ",".join(LOADERS), "--json", str(out), "--plot", str(png)]
    proc = run_python(AS_MODULE, *cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    wl = report["workload"]
    assert (wl["name"], wl["accelerator"], wl["batch_size"], wl["scale"]) == ("resnet50", "h100", 400, 64)
    assert wl["compute_s"] == 0.224 and wl["record_bytes"] == 114660.07 / 64
    assert report["data"]["samples"] == 400
    assert len(list((tmp_path / "data" / "files").iterdir())) == 400
    assert set(report["loaders"]) == set(LOADERS) and not report["skipped"]
    for name, entry in report["loaders"].items():
        (probe,) = entry["probes"]  # one accelerator, the cap: one run
        assert probe["n"] == 1 and 0.0 < probe["au"] <= 1.0, (name, probe)
        assert entry["max_accelerators"] == (1 if probe["au"] >= 0.9 else 0)
        assert entry["capped"] == (probe["au"] >= 0.9)
        assert probe["samples_per_s"] > 0
    for name in LOADERS:
        assert any(line.startswith(name + " ") for line in proc.stdout.splitlines()), proc.stdout
    assert "resnet50_h100.yaml" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

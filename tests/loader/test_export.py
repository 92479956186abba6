"""loader.stats() exported as JSON lines and TensorBoard scalars (stallfree/loader/export.py), from
a real loader over real shards; the TensorBoard event file is read back with tensorboard's own
EventAccumulator."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import stallfree
from stallfree.loader.export import StatsExporter, flatten_stats, stats_json_line, write_tensorboard
from stallfree.shards.writer import ShardWriter
from stallfree.testing.images import jpeg_bytes

ROOT = Path(__file__).resolve().parents[2]
N, BATCH, EVERY = 24, 4, 2
STEPS = N // BATCH


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    dst = tmp_path_factory.mktemp("export") / "ds"
    images = jpeg_bytes(N, sizes=((48, 40),))
    with ShardWriter(str(dst), format="tar", max_samples=10, classes=["a", "b"]) as w:
        for i in range(N):
            w.write({"__key__": f"k{i:03d}", "jpg": images[i], "cls": i % 2})
    return str(dst)


def _loader(data: str) -> stallfree.DataLoader:
    decode = stallfree.ImageDecode(train=True, size=16, device="cpu")
    return stallfree.DataLoader(
        stallfree.open_dataset(data), batch_size=BATCH, shuffle=True, seed=0, decode=decode
    )


def _train(loader, exporter: StatsExporter) -> list[dict]:
    """The loop the docs show; returns the snapshot of every export, in order."""
    snapshots = []
    for step, _batch in enumerate(loader, 1):
        snapshot = exporter.step(step)
        assert (snapshot is None) == bool(step % exporter.every)
        if snapshot is not None:
            snapshots.append(snapshot)
    return snapshots


def test_flatten_joins_nested_keys_and_keeps_only_chartable_scalars(data):
    loader = _loader(data)
    for _ in loader:
        pass
    stats = loader.stats()
    flat = flatten_stats(stats)
    assert flat["batches"] == STEPS and flat["samples"] == N and flat["failures"] == 0
    assert flat["queue/mean_occupancy"] == stats["queue"]["mean_occupancy"]
    assert flat["queue/capacity"] == stats["queue"]["capacity"]
    for stage, seconds in stats["stages_s"].items():
        assert flat[f"stages_s/{stage}"] == seconds
    assert flat["decode/images"] == N
    assert "failed_keys" not in flat and "cache" not in flat  # a list, and None without a cache
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat.values())
    assert "path" not in flat and "decode/backend" not in flat
    with_strings = flatten_stats(stats, numbers_only=False)
    assert with_strings["path"] == "fast" and with_strings["decode/backend"] == stats["decode"]["backend"]


def test_flatten_rules_on_edge_values():
    stats = {"a": True, "b": float("nan"), "c": float("inf"), "d": None, "e": [1, 2], "f": {"g": {"h": 3}}}
    assert flatten_stats(stats) == {"a": 1, "f/g/h": 3}
    assert flatten_stats({"x": {"y": 1.5}}, sep=".") == {"x.y": 1.5}


def test_json_line_is_strict_json_with_every_number(data):
    loader = _loader(data)
    for _ in loader:
        pass
    stats = loader.stats()
    row = json.loads(stats_json_line(stats, 7, wall_time=123.5))
    assert row == {"step": 7, "time": 123.5, **flatten_stats(stats, numbers_only=False)}
    assert list(row)[:2] == ["step", "time"]
    nan = json.loads(stats_json_line({"wait": float("nan"), "n": 2}, 1, wall_time=0.0))
    assert nan == {"step": 1, "time": 0.0, "n": 2}


def test_json_lines_every_n_steps_to_a_file_and_a_stream(data, tmp_path):
    path, stream = tmp_path / "stats.jsonl", io.StringIO()
    path.write_text('{"step": 0}\n')  # appended to, never truncated
    for dest in (path, stream):
        loader = _loader(data)
        with StatsExporter(loader, every=EVERY, jsonl=dest) as exporter:
            snapshots = _train(loader, exporter)
        text = path.read_text() if dest is path else stream.getvalue()
        rows = [json.loads(line) for line in text.splitlines()]
        if dest is path:
            assert rows.pop(0) == {"step": 0}
        assert [r["step"] for r in rows] == list(range(EVERY, STEPS + 1, EVERY))
        for row, snap in zip(rows, snapshots, strict=True):
            assert {k: v for k, v in row.items() if k not in ("step", "time")} == flatten_stats(
                snap, numbers_only=False
            )
            assert row["batches"] == row["step"] and row["samples"] == row["step"] * BATCH
    assert not stream.closed  # the caller's stream stays open


def test_close_exports_the_last_partial_interval_once(data):
    """6 steps with every=4: step 4 exports, and close() exports step 6, whose 2 steps would
    otherwise be in no line (issue 19.7); closing again exports nothing more."""
    stream = io.StringIO()
    loader = _loader(data)
    exporter = StatsExporter(loader, every=4, jsonl=stream)
    snapshots = _train(loader, exporter)
    assert [json.loads(line)["step"] for line in stream.getvalue().splitlines()] == [4]
    exporter.close()
    exporter.close()
    rows = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["step"] for r in rows] == [4, STEPS]
    assert rows[-1]["batches"] == STEPS and rows[-1]["samples"] == N
    assert rows[0]["batches"] == snapshots[0]["batches"] == 4
    idle = io.StringIO()
    StatsExporter(loader, every=4, jsonl=idle).close()  # no step seen: nothing to export
    assert idle.getvalue() == ""


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_file_holds_the_scalars(data, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is a dev dependency: pip install tensorboard")
    loader = _loader(data)
    with StatsExporter(loader, every=EVERY, tensorboard=tmp_path / "tb") as exporter:
        snapshots = _train(loader, exporter)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    scalars = _scalars(tmp_path / "tb")
    steps = list(range(EVERY, STEPS + 1, EVERY))
    assert set(scalars) == {f"stallfree/{k}" for k in flatten_stats(snapshots[-1])}
    assert scalars["stallfree/batches"] == [(s, float(s)) for s in steps]
    assert scalars["stallfree/samples"] == [(s, float(s * BATCH)) for s in steps]
    for tag, points in scalars.items():  # every number of every snapshot, stored as float32
        key = tag.removeprefix("stallfree/")
        assert [p[0] for p in points] == steps
        expected = [flatten_stats(snap)[key] for snap in snapshots]
        assert [p[1] for p in points] == pytest.approx(expected, rel=1e-6, abs=1e-30)


def test_tensorboard_into_the_users_writer_which_stays_open(data, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is a dev dependency: pip install tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    loader = _loader(data)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    writer.add_scalar("loss", 1.0, global_step=1)
    with StatsExporter(loader, every=STEPS, tensorboard=writer, prefix="data") as exporter:
        stats = _train(loader, exporter)[-1]
    assert write_tensorboard(writer, stats, STEPS + 1, prefix="") == len(flatten_stats(stats))
    writer.add_scalar("loss", 0.5, global_step=2)  # still open after the exporter closed
    writer.close()
    scalars = _scalars(tmp_path / "tb")
    assert scalars["loss"] == [(1, 1.0), (2, 0.5)]
    assert scalars["data/batches"] == [(STEPS, float(STEPS))]
    assert scalars["batches"] == [(STEPS + 1, float(STEPS))]


def test_bad_arguments(data):
    loader = _loader(data)
    for every in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every must be a positive"):
            StatsExporter(loader, every=every, jsonl=io.StringIO())
    with pytest.raises(ValueError, match="nothing to export to"):
        StatsExporter(loader)


def test_missing_tensorboard_says_how_to_install(tmp_path):
    """In a subprocess where the tensorboard package cannot be imported."""
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from stallfree.loader.export import open_summary_writer\n"
        "try:\n"
        f"    open_summary_writer({str(tmp_path / 'tb')!r})\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.startswith(
        "ERR TensorBoard export needs the tensorboard package: pip install tensorboard"
    )
    assert not (tmp_path / "tb").exists()

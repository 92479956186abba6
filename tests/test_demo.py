"""The Quick start's main job, end to end at a small size."""

import contextlib
import io
import re

import pytest

import stallfree
from stallfree.cli import main
from stallfree.gpu_decode.jpeg_info import jpeg_decoder


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory) -> tuple[int, str, str, object]:
    """One demo run both slow tests read (each run spawns the bench's ranks): 16 images, fewer
    than two of the bench's batches of 16 over its 2 ranks. Its exit code, stdout, stderr, workdir."""
    workdir = tmp_path_factory.mktemp("demo")
    out, err = io.StringIO(), io.StringIO()
    argv = ["demo", "--images", "16", "--workdir", str(workdir), "--batch-size", "8", "--size", "64"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*argv, "--bench-steps", "2"])
    return rc, out.getvalue(), err.getvalue(), workdir


@pytest.mark.slow
def test_demo_shards_loads_and_prints_bench_table(small_demo):
    rc, out, _, tmp_path = small_demo
    assert rc == 0
    lines = out.splitlines()  # the header: what the timings depend on
    assert lines[0] == f"stallfree {stallfree.__version__}" and lines[1].startswith("torch ")
    assert lines[2] == f"jpeg decoder: {jpeg_decoder()}"
    assert (tmp_path / "shards" / "manifest.json").is_file()
    assert (
        len(list((tmp_path / "shards").glob("*.idx"))) == len(list((tmp_path / "shards").glob("*.tar"))) > 0
    )
    assert re.search(r"16 samples in [\d.]+s = \d+ samples/s", out)
    assert "image (8, 3, 64, 64) torch.float32" in out
    rows = {
        line.split()[0]
        for line in out.splitlines()
        if line.split()[:2] in (["stallfree", "job"], ["torch", "job"])
    }
    assert rows == {"stallfree", "torch"}


def test_demo_refuses_too_few_images(tmp_path, capsys):
    assert main(["demo", "--images", "4", "--workdir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "stallfree demo: error: --images must be at least 8, got 4"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--workers", "-1"], "--workers must be 0 or more, got -1"),
        (["--size", "0"], "--size must be 1 to 1024 pixels, got 0"),
        (["--size", "100000"], "--size must be 1 to 1024 pixels, got 100000"),  # (960 GB of batch)
        (["--bench-steps", "-1"], "--bench-steps must be 0 or more, got -1"),
    ],
)
def test_demo_refuses_flags_it_cannot_run_before_making_anything(tmp_path, capsys, flags, message):
    assert main(["demo", "--images", "8", "--workdir", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"stallfree demo: error: {message}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_demo_with_fewer_images_than_two_bench_batches_runs_its_bench(small_demo):
    # 16 images over the bench's 2 ranks is 8 a rank: a batch of 16 never filled, and the bench
    # ended in a RankFailed traceback; its batch now fits the data
    rc, out, err, _ = small_demo
    assert rc == 0, err
    assert "Traceback" not in err
    assert "batch 8" in out  # the bench's header line

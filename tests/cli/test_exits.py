"""How commands end: output into a pipe whose reader went away (``stallfree inspect ... | head``)
ends quietly with 141, not a BrokenPipeError traceback (issue 30 item 7); ``stallfree doctor``
reports one line per check, or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stallfree
from stallfree.cli import EXIT_BROKEN_PIPE, doctor, main
from stallfree.extras import EXTRAS
from stallfree.gpu_decode.jpeg_info import jpeg_decoder
from stallfree.shards.writer import ShardWriter
from tests.zygote import AS_MODULE, run_python


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    dst = tmp_path / "ds"
    with ShardWriter(str(dst), max_samples=2) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "bin": bytes([i]) * 10})
    return dst


def run_into_closed_pipe(*argv: str) -> subprocess.CompletedProcess:
    """``stallfree ARGV`` with stdout a pipe whose read end is closed before the command starts:
    every write to it fails, as when ``head`` has exited."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "stallfree", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_inspect_into_a_closed_pipe_ends_quietly_with_141(dataset: Path, json_flag: list[str]):
    r = run_into_closed_pipe("inspect", str(dataset), *json_flag)
    assert r.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError" at exit
    assert r.returncode == EXIT_BROKEN_PIPE == 141


def test_help_version_and_doctor_into_a_closed_pipe_end_quietly():
    for argv in (["--version"], ["doctor"]):
        r = run_into_closed_pipe(*argv)
        assert r.stderr == "", (argv, r.stderr)
        assert r.returncode == EXIT_BROKEN_PIPE, argv
    r = run_into_closed_pipe("--help")  # argparse drops its own messages' write errors: exit 0
    assert (r.returncode, r.stderr) == (0, "")


def test_inspect_piped_into_head_prints_the_first_lines(dataset: Path):
    # the reader the issue names; whether the write is refused depends on timing, the output not
    r = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -m stallfree inspect "{dataset}" | head -n 2'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines() == [f"dataset:     {dataset}", "format:      tar (manifest version 1)"]


def parse_doctor(out: str) -> dict[str, tuple[str, str]]:
    """``[ok] name: detail`` lines -> {name: (mark, detail)}, in order."""
    checks = {}
    for line in out.splitlines():
        mark, rest = line[1:3], line[5:]
        name, _, detail = rest.partition(": ")
        checks[name.rstrip(":")] = (mark, detail.strip())
    return checks


def test_doctor_prints_one_line_per_check_and_every_extra(capsys):
    assert main(["doctor"]) == 0  # the dev environment has no problem
    out = capsys.readouterr().out
    checks = parse_doctor(out)
    assert len(checks) == len(out.splitlines())
    names = list(checks)
    assert names[:7] == ["stallfree", "python", "torch", "jpeg decoder", "dali", "nvimgcodec", "redis-server"]
    assert names[7:] == [f"[{name}]" for name in EXTRAS]
    assert checks["stallfree"] == ("ok", f"{stallfree.__version__} ({Path(stallfree.__file__).parents[1]})")
    assert checks["jpeg decoder"] == ("ok", str(jpeg_decoder()))  # the dev environment builds it
    assert checks["[plot]"][0] == "ok" and checks["[plot]"][1].startswith("matplotlib ")
    assert checks["[dali-cuda13]"] == (
        "--",
        "nvidia-dali-cuda130 not installed: GPU decode with DALI (for torch built for CUDA 13)",
    )


def test_doctor_json_has_the_same_checks(capsys):
    assert main(["doctor", "--json"]) == 0
    checks = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in checks][:3] == ["stallfree", "python", "torch"]
    assert {c["status"] for c in checks} <= {"ok", "missing", "warn", "problem"}
    by_name = {c["name"]: c for c in checks}
    assert by_name["[redis]"]["status"] == "ok" and "redis " in by_name["[redis]"]["detail"]
    assert by_name["jpeg decoder"]["detail"] == str(jpeg_decoder())


def test_doctor_warns_when_the_c_jpeg_decoder_is_not_built():
    # the build failure the issue found silent: the C extension made unimportable
    code = (
        "import sys\n"
        "sys.modules['stallfree.gpu_decode._turbo'] = None\n"
        "from stallfree.cli import main\n"
        "sys.exit(main(['doctor']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    mark, detail = parse_doctor(r.stdout)["jpeg decoder"]
    assert mark == "!!" and detail.startswith("pil (the C extension stallfree.gpu_decode._turbo is not built")
    assert detail.endswith("install gcc and libjpeg62-turbo-dev, then reinstall stallfree)")


@pytest.mark.parametrize(
    "installed, torch_cuda, status, detail",
    [
        (
            {"nvidia-dali-cuda120": "2.4.0"},
            "12.8",
            "ok",
            "nvidia-dali-cuda120 2.4.0, CUDA 12, as torch (CUDA 12.8)",
        ),
        (
            {"nvidia-dali-cuda120": "2.4.0"},
            "13.0",
            "problem",
            "nvidia-dali-cuda120 2.4.0 is built for CUDA 12, torch for CUDA 13.0: uninstall it and "
            "pip install 'stallfree[dali-cuda13]'",
        ),
        (
            {"nvidia-dali-cuda130": "2.4.0"},
            "12.6",
            "problem",
            "nvidia-dali-cuda130 2.4.0 is built for CUDA 13, torch for CUDA 12.6: uninstall it and "
            "pip install 'stallfree[dali]'",
        ),
        (
            {"nvidia-dali-cuda130": "2.4.0"},
            None,
            "warn",
            "nvidia-dali-cuda130 2.4.0 (CUDA 13), but torch is a CPU build: no GPU decode",
        ),
        (
            {"nvidia-dali-cuda120": "2.3.0", "nvidia-dali-cuda130": "2.4.0"},
            "13.0",
            "problem",
            "nvidia-dali-cuda120 2.3.0, nvidia-dali-cuda130 2.4.0: two builds of one module; uninstall all but one",
        ),
    ],
)
def test_doctor_checks_dali_s_cuda_against_torch_s(monkeypatch, installed, torch_cuda, status, detail):
    monkeypatch.setattr(
        doctor, "_installed", lambda dists: installed if dists is doctor.DALI_DISTRIBUTIONS else {}
    )
    monkeypatch.setattr(doctor, "_torch_cuda", lambda: torch_cuda)
    check = doctor._dali_check()
    assert (check.name, check.status, check.detail) == ("dali", status, detail)
    monkeypatch.setattr(doctor, "collect", lambda: [check])
    assert main(["doctor"]) == (1 if status == "problem" else 0)


def test_bench_prints_the_jpeg_decoder_above_its_table(capsys):
    argv = "bench synthetic:16:32x32 --nproc 1 --steps 2 --warmup 1 --batch-size 4 --workers 0 --step-ms 1"
    assert main([*argv.split(), "--loader", "stallfree", "--device", "cpu", "--no-per-rank"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"jpeg decoder: {jpeg_decoder()}"
    assert any(line.split()[:2] == ["stallfree", "job"] for line in lines[1:])


def test_bench_on_a_dataset_smaller_than_a_batch_is_one_line_not_a_traceback(dataset: Path):
    # one rank runs in the CLI's own process; its loader's error was a traceback there, while
    # spawned ranks (--nproc 2) already ended in one line through RankFailed
    r = run_python(  # python -m stallfree bench ..., forked from the test zygote (torch imported once)
        AS_MODULE, "stallfree", "bench", str(dataset), "--nproc", "1", "--steps", "2",
        "--warmup", "0", "--batch-size", "8", "--loader", "stallfree", "--step", "none", timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == [
        "stallfree bench: error: RuntimeError: loader 'stallfree' produced no batch "
        "in epoch 0: dataset smaller than batch_size x ranks x workers?"
    ], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("layout", ["mds", "mds-index", "litdata"])
def test_verify_of_an_mds_or_litdata_dataset_says_what_it_is_and_how(tmp_path: Path, capsys, layout: str):
    # it used to say "no manifest ... write one with `stallfree index`" (which refuses them), or,
    # given the index.json, "unknown manifest format version 2 (upgrade stallfree ...)"
    from tests.shards.test_source_litdata import write_litdata
    from tests.shards.test_source_mds import write_mds

    root = tmp_path / "ds"
    if layout == "litdata":
        write_litdata(root, [{"x": i} for i in range(4)], per_chunk=2)
    else:
        write_mds(root, {"x": "int"}, [{"x": i} for i in range(4)], per_shard=2)
    url = str(root / "index.json") if layout == "mds-index" else str(root)
    assert main(["verify", url, "--no-progress"]) == 1
    out, err = capsys.readouterr()
    what = "LitData" if layout == "litdata" else "MDS"
    assert out == ""
    assert err == (
        f"stallfree verify: error: {url} is a {what} dataset, read in place: it has no manifest.json "
        f"with sizes and digests to verify against. `stallfree shard {url} DST` reads every sample "
        "(damage is an error naming the file, sample and offset) and writes shards with a manifest; "
        "`stallfree verify DST` then checks them\n"
    )


BENCH = ["bench", "synthetic:8:16x16", "--nproc", "1", "--steps", "1", "--warmup", "0", "--step", "none"]


@pytest.mark.parametrize(
    "option, message",
    [
        ("foo=1", "--loader-option foo: stallfree.DataLoader takes no argument 'foo'"),
        ("batch_size=3", "--loader-option batch_size: the bench sets it; use --batch-size"),
        ("num_workers=0", "--loader-option num_workers: the bench sets it; use --workers"),
        ("shuffle=false", "--loader-option shuffle: the bench sets it (every loader it compares)"),
    ],
)
def test_bench_refuses_loader_options_it_cannot_pass_before_running(capsys, option: str, message: str):
    # they ended in a TypeError traceback from DataLoader, after the bench had started
    assert main([*BENCH, "--loader-option", option]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"stallfree bench: error: {message}\n")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_refuses_a_report_path_it_cannot_write_before_running(tmp_path: Path, capsys, flag: str):
    # the report used to fail after the whole run, in a FileNotFoundError traceback
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "report.out"  # under a file: no directory can be made there
    assert main([*BENCH, flag, str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"stallfree bench: error: {flag} {target}: cannot write there ("), err


@pytest.mark.parametrize("name", ["../../evil", "a/b", "..", ".", "", "a\\b"])
def test_shard_token_name_must_be_a_plain_file_stem(tmp_path: Path, capsys, name: str):
    # "../../evil" wrote evil.bin and evil.idx two directories above the destination
    with pytest.raises(SystemExit) as info:
        main(["shard", str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), "--tokenizer", "t.json",
              "--token-name", name])  # fmt: skip
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --token-name: {name!r} is not a plain file name stem" in err, err
    assert list(tmp_path.iterdir()) == []

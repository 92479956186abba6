"""``stallfree bench --loader stallfree,stallfree-remote``: where each batch was made (per rank,
per worker, text and JSON), the stall with and without remote workers, and the flags' checks.
No Ray cluster here (tests/engines/test_ray_workers.py runs the bench on a real one)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from stallfree.harness.config import REMOTE_LOADER, BenchConfig, RemoteSpec
from stallfree.harness.phases import Phase
from stallfree.harness.placement import rank_where_made, where_made
from stallfree.harness.plan import phase_run
from stallfree.harness.report import build_report, format_where_made


def _remote_stats(local: int, remote: int, workers: dict, **pool) -> dict:
    """A loader's ``stats()`` with remote workers, as ``ray_pool.RemoteStats.as_dict`` writes it."""
    counters = dict.fromkeys(
        (
            "reissued",
            "probes",
            "passed_over",
            "duplicates_dropped",
            "retried",
            "fell_back_to_local",
            "workers_lost",
        ),
        0,
    )
    counters.update(pool)
    return {
        "batches": local + remote,
        "num_workers": 2,
        "remote": {
            "workers": workers,
            "batches_local": local,
            "batches_remote": remote,
            "trainer_cpu_ms_per_batch": 0.5,
            "bytes_per_batch": 150_000.0,
            **counters,
        },
    }


def _worker(batches: int, node: str = "10.0.0.7", alive: bool = True) -> dict:
    return {
        "node": node,
        "alive": alive,
        "batches": batches,
        "samples": 8 * batches,
        "failures": 0,
        "cpu_s": 0.25 * batches,
        "busy_s": 0.3 * batches,
        "bytes_sent": 150_000 * batches,
        "in_flight_s": 0.04 * batches,
    }


def test_a_rank_lists_its_local_workers_then_each_remote_worker_with_its_node():
    stats = _remote_stats(6, 4, {2: _worker(3), 3: _worker(1, "10.0.0.8", alive=False)}, reissued=1, probes=2)
    p = rank_where_made(0, stats)
    assert p is not None
    assert (p["taken"], p["made"], p["made_local"], p["made_remote"]) == (10, 10, 6, 4)
    assert p["remote_share"] == pytest.approx(0.4)
    assert [r["label"] for r in p["rows"]] == [
        "local workers 0-1",
        "remote worker 2",
        "remote worker 3 (lost)",
    ]
    assert [r["node"] for r in p["rows"]] == ["trainer", "10.0.0.7", "10.0.0.8"]
    assert [r["batches"] for r in p["rows"]] == [6, 3, 1]
    assert sum(r["batches"] for r in p["rows"]) == p["taken"]
    assert [r["share"] for r in p["rows"]] == pytest.approx([0.6, 0.3, 0.1])
    local, two = p["rows"][0], p["rows"][1]
    assert local["cpu_s"] is None and local["bytes_sent"] is None and local["mean_in_flight_ms"] is None
    assert two["cpu_s"] == pytest.approx(0.75)
    assert two["bytes_sent"] == 450_000
    assert two["mean_in_flight_ms"] == pytest.approx(40.0)
    assert (p["reissued"], p["probes"], p["workers_lost"]) == (1, 2, 0)
    assert rank_where_made(0, {"batches": 3}) is None  # a loader without remote workers


def test_worker_ids_read_back_from_json_and_ranks_add_up_to_the_job():
    # spawned ranks hand their results over as JSON: the worker ids come back as strings
    rank1 = _remote_stats(2, 6, {"3": _worker(2), "2": _worker(4)}, workers_lost=1)
    rank1["num_workers"] = 0
    section = where_made([(1, rank1), (0, _remote_stats(5, 3, {2: _worker(3)}))])
    assert section is not None
    assert [p["rank"] for p in section["ranks"]] == [0, 1]
    assert [r["worker"] for r in section["ranks"][1]["rows"]] == [None, 2, 3]  # sorted as numbers
    assert section["ranks"][1]["rows"][0]["label"] == "main process (num_workers=0)"
    job = section["job"]
    assert (job["taken"], job["made_local"], job["made_remote"], job["workers_lost"]) == (16, 7, 9, 1)
    assert job["remote_share"] == pytest.approx(9 / 16)
    assert job["remote_workers"] == 3
    assert where_made([(0, {"batches": 1})]) is None


def _phase(label: str, stall: float, rate: float, stats: list[dict]) -> dict:
    """One gathered phase as the runner returns it: one result per rank."""
    summary = {  # each rank: its share of the job's samples, in one second
        "wall_s": 1.0,
        "samples": rate / len(stats),
        "samples_per_s": rate / len(stats),
        "stall_share": stall,
        "wait_p50_ms": 1.0,
        "wait_p99_ms": 2.0,
        "cpu_cores": 0.5,
        "step_p50_ms": 10.0,
        "steps": 2,
    }
    ranks = [
        {"summary": {**summary, "rank": r}, "timeline": [[0.0, 0.001, 0.01, 0.0]] * 3, "stats": s}
        for r, s in enumerate(stats)
    ]
    return {"phase": {"label": label, "loader": label}, "ranks": ranks}


def _bench_report(nproc: int = 2) -> dict:
    cfg = BenchConfig(
        dataset="synthetic:8", loaders=["stallfree", REMOTE_LOADER], nproc=nproc, steps=2, warmup=1
    )
    plain = [{"batches": 3}] * nproc
    remote = [_remote_stats(1 + r, 2, {2 + r: _worker(2)}) for r in range(nproc)]
    results = [_phase("stallfree", 0.5, 100.0, plain), _phase(REMOTE_LOADER, 0.05, 180.0, remote)]
    return build_report(cfg, results, {})


def test_the_report_json_has_the_section_and_the_stall_with_and_without_remote():
    rep = _bench_report()
    assert "where_made" not in rep["loaders"]["stallfree"]
    section = rep["loaders"][REMOTE_LOADER]["where_made"]
    assert [p["rank"] for p in section["ranks"]] == [0, 1]
    assert section["job"]["made_remote"] == 4
    effect = rep["remote_effect"]
    assert (effect["without"], effect["with"]) == ("stallfree", REMOTE_LOADER)
    assert (effect["stall_share_without"], effect["stall_share_with"]) == (0.5, 0.05)
    assert effect["speedup"] == pytest.approx(1.8)
    assert rep["config"]["remote"] is None  # the flags were not given: RemoteSpec's defaults ran
    alone = build_report(
        BenchConfig(dataset="synthetic:8", loaders=[REMOTE_LOADER], nproc=1),
        [_phase(REMOTE_LOADER, 0.1, 10.0, [_remote_stats(1, 1, {1: _worker(1)})])],
        {},
    )
    assert "remote_effect" not in alone  # nothing to compare with


def test_the_text_section_per_rank_and_for_the_job():
    text = format_where_made(_bench_report())
    lines = text.splitlines()
    assert lines[0] == "where the batches were made (the loaders' own counters, whole run, warm-up included):"
    assert lines[1].split() == [
        "loader", "rank", "worker", "node", "batches", "share", "%", "CPU-s", "MB", "sent", "in", "flight", "ms",
    ]  # fmt: skip
    rows = [line.split("  ") for line in lines[3:7]]
    assert [[c.strip() for c in r if c.strip()] for r in rows] == [
        [REMOTE_LOADER, "0", "local workers 0-1", "trainer", "1", "33.3", "-", "-", "-"],
        [REMOTE_LOADER, "0", "remote worker 2", "10.0.0.7", "2", "66.7", "0.500", "0.30", "40.0"],
        [REMOTE_LOADER, "1", "local workers 0-1", "trainer", "2", "50.0", "-", "-", "-"],
        [REMOTE_LOADER, "1", "remote worker 3", "10.0.0.7", "2", "50.0", "0.500", "0.30", "40.0"],
    ]
    assert lines[7] == (
        f"{REMOTE_LOADER} rank 0: the loop took 3 batches; the workers made 3 (2 remote, 66.7%); "
        "re-issued 0, probes 0, passed over 0, lost workers 0; a remote batch cost the trainer "
        "0.50 ms CPU and brought 150.0 kB"
    )
    assert lines[9] == (
        f"{REMOTE_LOADER} job (2 ranks): the loop took 7 batches; the workers made 7 (4 remote, 57.1%); "
        "re-issued 0, probes 0, passed over 0, lost workers 0"
    )
    assert lines[10] == (
        f"stall with remote workers: 5.0% ({REMOTE_LOADER}) vs 50.0% without (stallfree), job, worst "
        "rank; samples/s 180.0 vs 100.0 (1.80x)"
    )
    across_nodes = _bench_report()  # inside torchrun, one rank per node: ranks named as the table names them
    across_nodes["config"].update(rank=0, world_size=2, local_size=1)
    labels = [line.split()[1] for line in format_where_made(across_nodes).splitlines()[3:7]]
    assert labels == ["0@node0", "0@node0", "1@node1", "1@node1"]
    job_only = format_where_made(_bench_report(), per_rank=False).splitlines()
    assert not any(line.startswith(f"{REMOTE_LOADER} rank") for line in job_only)
    assert any(line.startswith(f"{REMOTE_LOADER} job (2 ranks)") for line in job_only)
    plain = _bench_report()
    del plain["loaders"][REMOTE_LOADER]
    assert format_where_made(plain) == ""


def test_batches_made_ahead_of_the_loop_are_told_apart():
    stats = _remote_stats(7, 5, {2: _worker(5)})
    stats["batches"] = 10  # the loop stopped mid-epoch: two batches were made but not taken
    stats["remote"]["bytes_per_batch"] = 9_633_900.0  # 16 float32 images of 224x224
    rep = {"loaders": {REMOTE_LOADER: {"where_made": where_made([(0, stats)])}}}
    line = next(x for x in format_where_made(rep).splitlines() if x.startswith(f"{REMOTE_LOADER} rank 0"))
    assert (
        "the loop took 10 batches; the workers made 12 (5 remote, 41.7%), 2 of them ahead of the loop" in line
    )
    assert line.endswith("a remote batch cost the trainer 0.50 ms CPU and brought 9.63 MB")


def test_only_the_remote_loader_gets_remote_workers_and_both_stallfree_loaders_the_options():
    spec = RemoteSpec(address="10.0.0.1:6379", workers=3, cpus=2.0, resource="cpu_node")
    cfg = BenchConfig(
        dataset="synthetic:8",
        loaders=["stallfree", REMOTE_LOADER, "torch"],
        loader_options={"window": 1},
        remote=spec,
    )
    runs = {name: phase_run(cfg, Phase(name)) for name in cfg.loaders}
    assert runs[REMOTE_LOADER].remote == spec
    assert runs["stallfree"].remote is None and runs["torch"].remote is None
    assert runs["stallfree"].loader_options == runs[REMOTE_LOADER].loader_options == {"window": 1}
    assert runs["torch"].loader_options == {}
    default = phase_run(BenchConfig(dataset="synthetic:8", loaders=[REMOTE_LOADER]), Phase(REMOTE_LOADER))
    assert default.remote == RemoteSpec()


def test_the_spec_makes_the_ray_workers_the_flags_describe():
    workers = RemoteSpec(address="10.0.0.1:6379", workers=3, cpus=2.0, resource="cpu_node").ray_workers()
    assert (workers.count, workers.cpus_per_worker, workers.address) == (3, 2.0, "10.0.0.1:6379")
    assert workers.resources == {"cpu_node": 2.0}
    assert RemoteSpec().ray_workers().resources == {}  # no resource: any node but the trainer's


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(loaders=["stallfree"], remote=RemoteSpec(workers=2)), "add it to --loader"),
        (
            dict(loaders=[REMOTE_LOADER], remote=RemoteSpec(workers=0)),
            "--remote-workers must be an integer >= 1",
        ),
        (dict(loaders=[REMOTE_LOADER], remote=RemoteSpec(cpus=0)), "--remote-cpus must be > 0"),
        (dict(loaders=[REMOTE_LOADER], remote=RemoteSpec(resource=" ")), "--remote-resource must name"),
    ],
)
def test_remote_settings_are_checked_naming_the_flag(settings, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(dataset="synthetic:8", **settings).validate()


def _no_ray(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )


def test_without_ray_the_remote_loader_names_the_extra(monkeypatch, capsys):
    from stallfree.cli import main
    from stallfree.extras import MissingExtra

    _no_ray(monkeypatch)
    with pytest.raises(MissingExtra, match=r"pip install 'stallfree\[ray\]'"):
        BenchConfig(dataset="synthetic:8", loaders=["stallfree", REMOTE_LOADER]).validate()
    rc = main(
        ["bench", "synthetic:8", "--loader", f"stallfree,{REMOTE_LOADER}", "--nproc", "1", "--device", "cpu"]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert (
        f"stallfree bench: error: stallfree bench --loader {REMOTE_LOADER} needs ray: pip install 'stallfree[ray]'"
        in err
    )
    assert "bench phases" not in err  # refused before any rank ran


def test_the_cli_refuses_remote_flags_without_the_remote_loader(capsys):
    from stallfree.cli import main

    rc = main(["bench", "synthetic:8", "--loader", "stallfree", "--remote-workers", "2", "--nproc", "1"])
    assert rc == 2
    assert (
        "--ray-address and --remote-* set the remote workers of --loader stallfree-remote"
        in capsys.readouterr().err
    )
    rc = main(
        ["bench", "synthetic:8", "--loader", REMOTE_LOADER, "--loader-option", "remote=1", "--nproc", "1"]
    )
    assert rc == 2
    assert (
        "--loader-option remote: the bench sets it; use --loader stallfree-remote" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "address, loopback", [("127.0.0.1:6379", True), ("localhost:6379", True), ("10.0.0.1:6379", False)]
)
def test_a_loopback_cluster_address_keeps_ray_on_loopback(monkeypatch, address, loopback):
    from stallfree.cli import build_parser
    from stallfree.cli.bench import remote_from_args

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    args = build_parser().parse_args(["bench", "d", "--loader", REMOTE_LOADER, "--ray-address", address])
    assert remote_from_args(args) == RemoteSpec(address=address)
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == ("0" if loopback else None)
    plain = build_parser().parse_args(["bench", "d"])
    assert remote_from_args(plain) is None

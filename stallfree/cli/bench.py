"""``stallfree bench``: measure data stall per rank, side by side across loaders."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

from stallfree.cli._common import describe, fail, parse_key_value

EPILOG = """examples:
  stallfree bench ./in1k --nproc 2 --loader stallfree,torch --step-ms 20 --json out.json --plot out.png
  stallfree bench http://127.0.0.1:8000/shards --loader stallfree,torch,webdataset --analyze
  stallfree bench ./in1k --loader torch --tune --tune-workers 1,2,4
  stallfree bench ./in1k --loader stallfree,stallfree-remote --ray-address HEAD_IP:6379 --remote-workers 4 \
      --remote-resource cpu_node
  torchrun --nproc-per-node 8 -m stallfree bench s3://bucket/in1k --step model
  stallfree bench ./au-data --workload unet3d --accelerator h100 --json au.json --plot au.png
"""

DEFAULT_LOADERS = "stallfree,torch"


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _option(text: str) -> tuple[str, object]:
    """A ``--loader-option`` value, ``KEY=VALUE`` (VALUE read as JSON when it parses)."""
    try:
        return parse_key_value(text, "loader option")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure time blocked on data per rank, per loader; explain it and what would remove it",
        description=describe(
            "Launch --nproc ranks (or join torchrun's), each a DDP-like loop of next batch, step and "
            "all-reduce, over each --loader in turn on the same shards, and report per loader: samples/s, "
            "stall share (time blocked in next() / step time; the worst rank is the job's), wait p50/p99, "
            "CPU cores, and the decode each loader ran (stallfree: ImageDecode unless --decode recipe; "
            "torch and webdataset: the PIL recipe; dali: DALI's own operators). --analyze splits stall "
            "into fetch and prep and predicts a cache size or storage bandwidth; --tune sweeps workers "
            "and prefetch depth."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument(
        "dataset",
        help="shard dataset path or URL (http://, s3://, ...), or synthetic:N[:WxH]; with --workload the "
        "folder its data is written to (created, or reused when it holds the same workload's data)",
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks to launch (ignored inside torchrun; default 2)"
    )
    p.add_argument(
        "--loader",
        default=None,
        help="comma list: stallfree,stallfree-remote,torch,webdataset,dali (default stallfree,torch; with "
        "--workload stallfree,torch,webdataset,dali); stallfree-remote: stallfree plus Ray remote workers",
    )
    p.add_argument(
        "--step",
        default="sleep",
        choices=["sleep", "busy", "model", "none"],
        help="sleep: emulated GPU step; busy: CPU compute; model: small ResNet-like net (default sleep)",
    )
    p.add_argument("--step-ms", type=float, default=20.0, help="cost of a sleep/busy step in ms (default 20)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch per rank (default 32)")
    p.add_argument("--workers", type=int, default=2, help="loader workers per rank (default 2)")
    p.add_argument(
        "--prefetch", type=int, default=None, help="loader prefetch factor (default: the loader's)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per loader (default 50; --workload: 2 s of emulated compute, at least 8)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps run before measuring (default 3; --workload: a tenth of the steps, at least 2)",
    )
    p.add_argument("--image-size", type=int, default=64, help="crop size of the decode recipe (default 64)")
    p.add_argument(
        "--decode",
        default="auto",
        choices=["auto", "recipe", "image-decode"],
        help="stallfree's decode: PIL recipe per sample, or ImageDecode (default auto)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available; default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--worker-start",
        default="forkserver",
        choices=["fork", "forkserver", "spawn"],
        help="how every loader's workers start (default forkserver: safe beside gloo threads)",
    )
    p.add_argument(
        "--loader-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra stallfree.DataLoader keyword, e.g. window=1 or autotune=true (repeatable)",
    )
    p.add_argument(
        "--cache-share",
        type=float,
        default=0.0,
        help="share of the dataset held warm in memory in front of storage (default 0)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the full report (with environment) here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG timeline + stall bar chart here")
    p.add_argument("--no-per-rank", action="store_true", help="table: job rows only")
    r = p.add_argument_group(
        "remote workers on Ray (--loader stallfree-remote)",
        "stallfree-remote is the stallfree loader plus remote=stallfree.RayWorkers(...): per rank, "
        "--remote-workers Ray actors on the cluster's CPU nodes decode beside the --workers local "
        "ones. Run it beside stallfree to see the stall with and without them, and where each batch "
        "was made (docs/remote_workers.md). Needs pip install 'stallfree[ray]' and a running cluster.",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster, HOST:PORT or auto (default: auto, the cluster this machine belongs to)",
    )
    r.add_argument("--remote-workers", type=int, default=None, help="Ray actors per rank (default 2)")
    r.add_argument(
        "--remote-resource",
        default=None,
        metavar="NAME",
        help="custom Ray resource the CPU nodes carry (ray start --resources '{\"NAME\": N}'); "
        "default: none, any node but the trainer's",
    )
    r.add_argument("--remote-cpus", type=float, default=None, help="CPUs per remote worker (default 1)")
    w = p.add_argument_group(
        "MLPerf Storage workloads (--workload)",
        "N emulated accelerators (ranks sleeping the config's compute time per batch) read the "
        "workload's records without decoding them; per loader, the largest N whose accelerator "
        "utilisation (compute time / wall time, mean over ranks) stays at or above the threshold "
        "(90%% resnet50 and unet3d, 70%% cosmoflow). Uses --workers, --steps, --seed, --loader.",
    )
    w.add_argument("--workload", choices=["resnet50", "unet3d", "cosmoflow"], default=None)
    w.add_argument("--accelerator", choices=["h100", "a100", "b200"], default="h100", help="default h100")
    w.add_argument(
        "--scale",
        type=int,
        default=None,
        help="divide record sizes by this (default: resnet50 1, unet3d 64, cosmoflow 8)",
    )
    w.add_argument("--max-accelerators", type=int, default=8, help="largest N searched (default 8)")
    w.add_argument("--samples", type=int, default=None, help="samples to write (default per workload)")
    a = p.add_argument_group("analysis (--analyze)")
    a.add_argument(
        "--analyze", action="store_true", help="split stall into fetch vs prep and check a what-if"
    )
    a.add_argument(
        "--analyze-loader", default=None, help="loader to analyse (default: first of stallfree/torch)"
    )
    a.add_argument(
        "--whatif-cache-share", type=float, default=0.5, help="cached share to predict (default 0.5)"
    )
    a.add_argument("--whatif-cache-gb", type=float, default=None, help="cache size to predict, in GB")
    a.add_argument(
        "--whatif-storage-mbps", type=float, default=None, help="storage bandwidth to predict, MB/s"
    )
    t = p.add_argument_group("tuning (--tune)")
    t.add_argument(
        "--tune", action="store_true", help="sweep workers x prefetch; report the cheapest stall-free"
    )
    t.add_argument("--tune-workers", type=_int_list, default=[1, 2, 4], help="default 1,2,4")
    t.add_argument("--tune-prefetch", type=_int_list, default=[2, 4], help="default 2,4")
    t.add_argument("--tune-target", type=float, default=2.0, help="stall %% counted as removed (default 2)")
    p.set_defaults(func=run)


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torchrun_world() -> dict[str, object]:
    """torchrun's rank and rendezvous from the environment (the CLI is where env is read)."""
    from stallfree.loader.epoch.world import world_from_env

    world = world_from_env(os.environ)
    if world is None:
        return {}
    return {
        "rank": world.rank,
        "world_size": world.size,
        "local_rank": world.local_rank,
        "local_size": world.local_size,
        # torchrun's agent already serves the rendezvous store at MASTER_ADDR:MASTER_PORT; env://
        # joins it (a tcp:// URL would try to bind that port again).
        "init_method": "env://",
        "nproc": world.size,
    }


# stallfree.DataLoader arguments the bench passes itself: the flag that sets each (None: the same
# for every loader it compares); a --loader-option naming one would be a TypeError mid-run
_BENCH_SETS = {
    "dataset": None,
    "shuffle": None,
    "drop_last": None,
    "world": None,
    "persistent_workers": None,
    "batch_size": "--batch-size",
    "num_workers": "--workers",
    "seed": "--seed",
    "device": "--device",
    "prefetch_factor": "--prefetch",
    "decode": "--decode",
    "collate_fn": "--decode",
    "multiprocessing_context": "--worker-start",
    "remote": "--loader stallfree-remote",
}


def check_loader_options(options: dict[str, object]) -> None:
    """ValueError naming the first ``--loader-option`` that ``stallfree.DataLoader`` does not take
    or that the bench sets from its own flags; before the run, not as a TypeError in a rank."""
    import inspect

    from stallfree.loader.dataloader import DataLoader

    accepted = inspect.signature(DataLoader.__init__).parameters
    for name in options:
        if name in _BENCH_SETS:
            flag = _BENCH_SETS[name]
            how = f"use {flag}" if flag else "every loader it compares"
            raise ValueError(
                f"--loader-option {name}: the bench sets it" + (f"; {how}" if flag else f" ({how})")
            )
        if name not in accepted or name == "self":
            raise ValueError(f"--loader-option {name}: stallfree.DataLoader takes no argument {name!r}")


def check_writable(flag: str, path: Path) -> None:
    """ValueError when the report ``path`` cannot be written, found before minutes of running
    rather than after. Probed by creating the file (removed again if it was not there)."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def config_from_args(args: argparse.Namespace):
    """The BenchConfig the flags describe (plus torchrun's world when running under it)."""
    from stallfree.harness.runner import BenchConfig

    world = _torchrun_world()
    cfg = BenchConfig(
        dataset=args.dataset,
        loaders=_loaders(args.loader or DEFAULT_LOADERS),
        nproc=int(world.pop("nproc", args.nproc)),
        step=args.step,
        step_ms=args.step_ms,
        batch_size=args.batch_size,
        workers=args.workers,
        prefetch=args.prefetch,
        steps=50 if args.steps is None else args.steps,
        warmup=3 if args.warmup is None else args.warmup,
        image_size=args.image_size,
        seed=args.seed,
        device=_device(args.device),
        decode=args.decode,
        worker_start=args.worker_start,
        loader_options=dict(args.loader_option),
        cache_fraction=args.cache_share,
        analyze=args.analyze,
        analyze_loader=args.analyze_loader,
        whatif_cache_fraction=args.whatif_cache_share,
        whatif_cache_bytes=args.whatif_cache_gb * 1e9 if args.whatif_cache_gb else None,
        whatif_storage_bytes_per_s=args.whatif_storage_mbps * 1e6 if args.whatif_storage_mbps else None,
        tune=args.tune,
        tune_workers=args.tune_workers,
        tune_prefetch=args.tune_prefetch,
        tune_target_stall=args.tune_target / 100.0,
        progress=True,
        remote=remote_from_args(args),
        **world,
    )
    return cfg


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def _remote_flags(args: argparse.Namespace) -> dict[str, object]:
    """The ``--ray-address`` / ``--remote-*`` flags given, as RemoteSpec's fields."""
    flags = {
        "address": args.ray_address,
        "workers": args.remote_workers,
        "cpus": args.remote_cpus,
        "resource": args.remote_resource,
    }
    return {k: v for k, v in flags.items() if v is not None}


def remote_from_args(args: argparse.Namespace):
    """The RemoteSpec of ``--ray-address`` and ``--remote-*`` (None when none is given: the
    stallfree-remote loader then gets RemoteSpec's defaults).

    A cluster on this machine's loopback (``127.0.0.1:PORT``) needs Ray to keep that address when
    a driver connects: Ray 2.60 replaces it by the machine's outside address and retries that for
    ever unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (stallfree/testing/ray_cluster.py). The
    CLI is where environment variables are set: here, before any rank imports Ray, unless the
    user set it."""
    from stallfree.harness.config import RemoteSpec

    given = _remote_flags(args)
    if not given:
        return None
    address = args.ray_address
    if address and address.rpartition(":")[0] in _LOOPBACK_HOSTS:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return RemoteSpec(**given)


def _loaders(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def au_config_from_args(args: argparse.Namespace):
    """The AUConfig of a ``--workload`` bench (its own flags, and the shared ones it uses)."""
    from stallfree.harness.workload.run import DEFAULT_LOADERS as AU_LOADERS
    from stallfree.harness.workload.run import AUConfig

    return AUConfig(
        data=str(args.dataset),
        workload=args.workload,
        accelerator=args.accelerator,
        scale=args.scale,
        samples=args.samples,
        loaders=tuple(_loaders(args.loader)) if args.loader else AU_LOADERS,
        max_n=args.max_accelerators,
        workers=args.workers,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        worker_start=args.worker_start,
        loader_options=dict(args.loader_option),
    )


def run_workload(args: argparse.Namespace) -> int:
    """``--workload``: the largest number of emulated accelerators per loader (au_bench.py)."""
    from stallfree.harness.errors import RankFailed, error_line
    from stallfree.harness.workload.report import format_au_table, write_au_plot
    from stallfree.harness.workload.run import run_au_bench

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.plot:
        from stallfree.extras import require

        require("matplotlib", "plot", "stallfree bench --plot")
    try:
        check_loader_options(dict(args.loader_option))
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                check_writable(flag, path)
        result = run_au_bench(au_config_from_args(args), progress)
    except RankFailed as exc:
        return fail("bench", error_line(exc))
    except ValueError as exc:
        return fail("bench", error_line(exc), code=2)
    print(format_au_table(result))
    try:
        if args.json:
            args.json.write_text(json.dumps(_finite(result), indent=1))
            print(f"report: {args.json}", file=sys.stderr)
        if args.plot:
            write_au_plot(result, args.plot)
            print(f"plot: {args.plot}", file=sys.stderr)
    except OSError as exc:
        return fail("bench", f"writing the report: {exc}")
    return 0


def _finite(value):
    """JSON has no infinity: write unbounded rates as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def run(args: argparse.Namespace) -> int:
    from stallfree.errors import ShardError
    from stallfree.extras import require
    from stallfree.gpu_decode.jpeg_info import jpeg_decoder
    from stallfree.harness import report as rpt
    from stallfree.harness.errors import RankFailed, error_line
    from stallfree.harness.runner import run_bench

    if args.workload:
        if _remote_flags(args):
            return fail("bench", "--ray-address and --remote-* do not apply to --workload", code=2)
        return run_workload(args)
    dataset = str(args.dataset)
    if "://" not in dataset and not dataset.startswith("synthetic:") and not Path(dataset).exists():
        return fail("bench", f"dataset {dataset} does not exist", code=2)
    if args.plot:  # before the run, not after minutes of it
        require("matplotlib", "plot", "stallfree bench --plot")
    try:
        check_loader_options(dict(args.loader_option))
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                check_writable(flag, path)
        cfg = config_from_args(args)
        result = run_bench(cfg)
    except (ShardError, RankFailed) as exc:  # bad data met by a loader, in this process or a rank
        return fail("bench", error_line(exc))  # a worker's error carries its traceback: one line
    except ValueError as exc:  # settings that cannot run
        return fail("bench", error_line(exc), code=2)
    except RuntimeError as exc:  # a loader failing in a rank this process runs (--nproc 1, torchrun):
        # one line, as RankFailed gives for a spawned rank; the traceback with -vv
        logging.getLogger(__name__).debug("the bench failed", exc_info=True)
        return fail("bench", f"{type(exc).__name__}: {error_line(exc)}")
    if result is None:  # a non-zero rank inside torchrun: rank 0 reports
        return 0
    # the CPU decode's speed depends on it: a PIL fallback (C decoder not built) shows here
    print(f"jpeg decoder: {jpeg_decoder()}")
    print(rpt.format_table(result, per_rank=not args.no_per_rank))
    where = rpt.format_where_made(result, per_rank=not args.no_per_rank)
    if where:  # a loader with remote workers (--loader stallfree-remote)
        print()
        print(where)
    if "analysis" in result:
        print()
        print(rpt.format_analysis(result["analysis"]))
    if "tune" in result:
        print()
        print(rpt.format_tune(result["tune"]))
    try:  # (checked before the run; a disk that filled up since still ends in one line)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(_finite(result), indent=1))
            print(f"report: {args.json}", file=sys.stderr)
        if args.plot:
            rpt.write_plot(result, args.plot)
            print(f"plot: {args.plot}", file=sys.stderr)
    except OSError as exc:
        return fail("bench", f"writing the report: {exc}")
    return 0

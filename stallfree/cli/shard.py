"""``stallfree shard`` (write shards from a source) and ``stallfree index`` (manifest + ``.idx``
for existing WebDataset tars)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stallfree.cli._common import add_storage_option, describe, fail, parse_key_value, storage_options

SOURCE_KINDS = ("imagefolder", "files", "jsonl", "parquet", "arrow", "hf", "mds", "litdata", "tar")


def register(sub: argparse._SubParsersAction) -> None:
    from stallfree.shards.formats import format_names

    p = sub.add_parser(
        "shard",
        help="write tar or Arrow shards (+ manifest.json, .idx) from images, tables or tars",
        description=describe(
            "Write training-ready shards from SRC: an ImageFolder tree (class = sub-folder), a folder of "
            "files grouped by base name (a.jpg + a.json -> one sample), JSONL / Parquet / Arrow tables "
            "(one row per sample), a Hugging Face datasets save_to_disk directory or .arrow / .parquet "
            "files (Image/Audio columns as encoded bytes, ClassLabel names as the manifest's classes), "
            "a MosaicML MDS or LitData dataset directory (index.json), or existing tar shards "
            "(re-shard). ImageFolder and grouped-file sources, and Hugging Face rows sorted by their "
            "ClassLabel, are shuffled (seed 0, recorded in the manifest) unless --no-shuffle: shards in class order give single-class batches to "
            "readers that stream shards in order. Output is identical for any --workers and --engine."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  stallfree shard ./imagenet/train ./in1k --format tar --max-bytes 256MB --workers 8\n"
            "  stallfree shard 'tokens/*.parquet' s3://bucket/tokens --format arrow --max-samples 100000\n"
            "  stallfree shard ./old-tars ./reshuffled --shuffle-seed 0 --on-error skip --json\n"
            "  stallfree shard ./hf-saved-dataset ./hf-shards --max-samples 1000\n"
            "  stallfree shard ./mds-dataset ./shards --no-shuffle\n"
            "  stallfree shard s3://bucket/hf-dataset ./shards --source-option anon=true\n"
            "  stallfree shard ./imagenet/train ./in1k-320 --max-side 320 --quality 90 --workers 8\n"
            "  stallfree shard s3://bucket/raw.parquet s3://bucket/shards --engine spark:spark://head:7077\n"
            "  stallfree shard s3://bucket/images s3://bucket/shards --engine ray:auto\n"
            "  stallfree shard 'text/*.jsonl' ./tokens --tokenizer tokenizer.json --token-layout megatron"
        ),
    )
    p.add_argument(
        "src",
        help="source: directory, file, or glob pattern (local), or a URL of a dataset open_dataset reads "
        "(tar / Arrow / Parquet shards, a Hugging Face save_to_disk directory; e.g. s3://bucket/ds)",
    )
    p.add_argument("dst", help="destination directory: a local path or any fsspec URL")
    p.add_argument("--format", choices=format_names(), default="tar", help="shard format (default tar)")
    p.add_argument("--source", choices=SOURCE_KINDS, default=None, help="source kind (default: detected)")
    p.add_argument("--max-bytes", default="256MB", help="shard size limit, e.g. 256MB, 1GiB (default 256MB)")
    p.add_argument("--max-samples", type=int, default=None, help="at most N samples per shard")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards in parallel (default 1)")
    p.add_argument(
        "--engine",
        default="local",
        metavar="local|ray[:ADDRESS]|spark[:MASTER]",
        help="where the shard tasks run: local processes (--workers, the default), a Ray cluster "
        "(ray:auto, ray:HOST:PORT; stallfree[ray]) or Spark (spark:local[4], spark:spark://HOST:7077; "
        "stallfree[spark]); the plan and manifest stay here, the output is the same bytes",
    )
    p.add_argument(
        "--shared-fs",
        action="store_true",
        help="local SRC/DST paths are on a filesystem every node of the --engine cluster mounts at "
        "the same path (without it a cluster with other machines is refused local paths)",
    )
    order = p.add_mutually_exclusive_group()
    order.add_argument(
        "--shuffle-seed",
        type=_seed,
        default="auto",
        help="shuffle samples with this seed before sharding (default: seed 0 for ImageFolder, "
        "grouped files and class-sorted Hugging Face rows; source order for the rest)",
    )
    order.add_argument(
        "--no-shuffle",
        dest="shuffle_seed",
        action="store_const",
        const=None,
        help="keep the source's order (ImageFolder: class by class)",
    )
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="unreadable source files: stop (raise, default) or skip and list them",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset already at DST (all or nothing: if this run fails, the old one is untouched)",
    )
    p.add_argument(
        "--name", default="shard-{index:06d}", help="shard name pattern (default shard-{index:06d})"
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=None,
        metavar="N",
        help="re-encode images whose long side is over N px to a long side of N (aspect kept); "
        "smaller images keep their bytes; recorded in the manifest",
    )
    p.add_argument(
        "--quality",
        type=int,
        default=None,
        metavar="Q",
        help="JPEG/WebP quality for images --max-side re-encodes, 1-100 (default 90)",
    )
    add_storage_option(p, "DST")
    p.add_argument(
        "--source-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for a URL SRC (value parsed as JSON when it can be), repeatable",
    )
    t = p.add_argument_group("token shards (language-model data)")
    t.add_argument(
        "--tokenizer",
        metavar="TOKENIZER_JSON",
        default=None,
        help="tokenize the text of JSONL/Parquet SRC with this Hugging Face tokenizer.json into token files",
    )
    t.add_argument("--text-field", default="text", help="the text column or JSON key (default text)")
    t.add_argument(
        "--token-layout",
        choices=("megatron", "arrow"),
        default="megatron",
        help="megatron: NAME.bin + NAME.idx; arrow: Arrow shards with an input_ids column (default megatron)",
    )
    t.add_argument(
        "--token-name",
        type=_file_stem,
        default="tokens",
        help="file name stem of the token files (default tokens)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=run_shard)

    q = sub.add_parser(
        "index",
        help="write manifest.json and DALI .idx files for existing WebDataset tars",
        description=describe(
            "Index existing WebDataset tar shards in place: one DALI-compatible .idx beside each tar and a "
            "manifest.json (sample counts, sizes, sha256) in their directory, so open_dataset reads them "
            "by global index without scanning."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree index ./wds/shard-*.tar\n  stallfree index ./wds/*.tar --json",
    )
    q.add_argument("tars", nargs="+", help="tar shards (all in one directory), or that directory")
    q.add_argument("--overwrite", action="store_true", help="replace an existing manifest.json")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    q.set_defaults(func=run_index)


def _seed(text: str) -> int | str:
    """``--shuffle-seed``: an integer, or ``auto`` (the default: shuffle grouped sources only)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer seed (or 'auto'): {text!r}") from None


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _text_files(src: str) -> list[str]:
    """The JSONL/Parquet files SRC names: a file, a directory of them, or a glob pattern."""
    import glob
    import os

    if os.path.isdir(src):
        files = [os.path.join(src, f) for f in sorted(os.listdir(src))]
        files = [f for f in files if f.endswith((".jsonl", ".parquet"))]
    elif glob.has_magic(src):
        files = sorted(glob.glob(src))
    else:
        files = [src] if os.path.exists(src) else []
    if not files:
        raise ValueError(f"no .jsonl or .parquet text files at {src}")
    return files


def _file_stem(text: str) -> str:
    """``--token-name``: a name for files inside DST; a path (``../x``) would write outside it."""
    from stallfree.tokens.tokenize import check_name  # the library's own rule (no tokenizer import)

    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_tokenize(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``stallfree shard SRC DST --tokenizer T``: text documents to token files (+ tokens.json)."""
    from tqdm import tqdm

    from stallfree.errors import ShardError
    from stallfree.tokens.tokenize import tokenize_files

    tqdm.monitor_interval = 0
    try:
        files = _text_files(args.src)
        with tqdm(unit=" docs", desc="tokenizing", file=sys.stderr, disable=args.no_progress) as bar:
            info = tokenize_files(
                files,
                args.dst,
                args.tokenizer,
                layout=args.token_layout,
                text_field=args.text_field,
                name=args.token_name,
                progress=lambda docs, _tokens: bar.update(docs - bar.n),
                **options,
            )
    except (ShardError, ValueError, OSError, KeyError) as exc:
        return fail("shard", exc)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(
            f"wrote {info.get('documents', 0):,} documents, {info.get('tokens', 0):,} tokens "
            f"({args.token_layout}) to {args.dst}"
        )
    return 0


def run_shard(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from stallfree.errors import ShardError
    from stallfree.shards.parallel import shard_dataset
    from stallfree.shards.sources.registry import open_source
    from stallfree.shards.writer import parse_size

    try:
        max_bytes = parse_size(args.max_bytes)
        options = storage_options(args)
        src_options = dict(parse_key_value(pair, "source option") for pair in args.source_option)
        if max_bytes <= 0:
            raise ValueError(f"--max-bytes must be positive, got {args.max_bytes}")
        if args.max_samples is not None and args.max_samples <= 0:
            raise ValueError(f"--max-samples must be positive, got {args.max_samples}")
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        engine = _engine(args)
        transform = _downscale(args)
    except ValueError as exc:
        return fail("shard", exc, 2)
    if args.tokenizer is not None:
        return run_tokenize(args, options)

    tqdm.monitor_interval = 0  # no monitor thread: worker processes are forked after the bar starts
    bar: list[Any] = []

    def on_plan(samples: int, shards: int, nbytes: int) -> None:
        print(f"planned {samples:,} samples into {shards:,} shard(s), ~{_mb(nbytes)}", file=sys.stderr)
        bar.append(
            tqdm(
                total=nbytes,
                unit="B",
                unit_scale=True,
                desc="sharding",
                file=sys.stderr,
                disable=args.no_progress,
                dynamic_ncols=True,
            )
        )

    def progress(samples: int, nbytes: int) -> None:
        if bar:
            bar[0].update(nbytes)

    try:
        executor = None
        if engine.name != "local":
            from stallfree.engines.executor import make_executor

            executor = make_executor(engine, workers=args.workers, shared_fs=args.shared_fs)
        source = open_source(args.src, args.source, on_error=args.on_error, storage_options=src_options)
        summary = shard_dataset(
            source,
            args.dst,
            format=args.format,
            max_bytes=max_bytes,
            max_samples=args.max_samples,
            workers=args.workers,
            shuffle_seed=args.shuffle_seed,
            on_error=args.on_error,
            name=args.name,
            overwrite=args.overwrite,
            progress=progress,
            on_plan=on_plan,
            transform=transform,
            executor=executor,
            **options,
        )
    except (ShardError, ValueError, OSError) as exc:
        if bar:
            bar[0].close()
        return fail("shard", exc)
    finally:
        if executor is not None:
            executor.close()
    if bar:
        bar[0].close()
    info = summary.to_json()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(
        f"wrote {info['samples']:,} samples in {info['shards']:,} {args.format} shard(s), {_mb(info['bytes'])}, "
        f"to {args.dst} in {info['seconds']:.2f}s ({info['mb_per_s'] or 0:,.1f} MB/s)"
    )
    print(f"manifest: {info['manifest']}")
    if transform is not None:
        t = info["transform"]
        print(
            f"resized {t['resized']:,} image(s) to a long side of {t['max_side']} px (quality {t['quality']})"
        )
    if summary.skipped:
        print(f"skipped {len(summary.skipped)} unreadable source item(s) (listed in the manifest):")
        for s in summary.skipped[:20]:
            print(f"  {s['source']}: {s['error']}")
        if len(summary.skipped) > 20:
            print(f"  ... and {len(summary.skipped) - 20} more")
    else:
        print("skipped: none")
    return 0


def _engine(args: argparse.Namespace) -> Any:
    """``--engine``, parsed (ValueError for an unknown one, or flags it does not take)."""
    from stallfree.engines.executor import parse_engine

    engine = parse_engine(args.engine)
    if engine.name != "local" and args.tokenizer is not None:
        raise ValueError("--engine applies to sample shards, not with --tokenizer (which runs here)")
    if engine.name == "local" and args.shared_fs:
        raise ValueError("--shared-fs applies only with a cluster --engine (ray, spark)")
    if engine.name != "local" and args.workers != 1:
        raise ValueError(f"--workers applies to --engine local; {engine.name} runs one task per shard")
    return engine


def _downscale(args: argparse.Namespace) -> Any:
    """The ``--max-side`` transform, or None; ValueError for flags that do not go together."""
    if args.max_side is None:
        if args.quality is not None:
            raise ValueError("--quality applies only with --max-side")
        return None
    if args.tokenizer is not None:
        raise ValueError("--max-side applies to image shards, not with --tokenizer")
    if args.max_side < 1:
        raise ValueError(f"--max-side must be a positive number of pixels, got {args.max_side}")
    if args.quality is not None and not 1 <= args.quality <= 100:
        raise ValueError(f"--quality must be from 1 to 100, got {args.quality}")
    from stallfree.gpu_decode.downscale import DEFAULT_QUALITY, Downscale

    return Downscale(args.max_side, DEFAULT_QUALITY if args.quality is None else args.quality)


def run_index(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from stallfree.errors import ShardError
    from stallfree.shards.tar.indexing import index_tars

    tqdm.monitor_interval = 0
    try:
        with tqdm(
            total=None, unit="shard", desc="indexing", file=sys.stderr, disable=args.no_progress
        ) as bar:
            result = index_tars(args.tars, overwrite=args.overwrite, progress=lambda n: bar.update(n))
    except (ShardError, ValueError, OSError) as exc:
        return fail("index", exc)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(
            f"indexed {result['samples']:,} samples in {result['shards']:,} tar(s), {_mb(result['bytes'])}; "
            f"manifest: {result['manifest']}"
        )
    return 0

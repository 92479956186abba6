"""``stallfree inspect`` (what a dataset holds) and ``stallfree verify`` (is it intact)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stallfree.cli._common import add_storage_option, describe, fail, storage_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarise a sharded dataset: format, samples, shards, bytes, fields, classes",
        description=describe(
            "Summarise a dataset from its manifest and first sample (reads no other shard data). Plain "
            "WebDataset tars without a manifest are indexed on the fly."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example:\n  stallfree inspect ./in1k\n  stallfree inspect s3://bucket/in1k --json\n"
            "  stallfree inspect s3://bucket/in1k -o endpoint_url=http://127.0.0.1:9000 -o anon=true"
        ),
    )
    p.add_argument("dataset", help="dataset directory (or its manifest.json): local path or fsspec URL")
    p.add_argument("--shards", type=int, default=5, help="list the first N shards (default 5)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    add_storage_option(p, "DATASET")
    p.set_defaults(func=run_inspect)

    v = sub.add_parser(
        "verify",
        help="check sizes, sha256 hashes and index consistency of every shard (optionally decode images)",
        description=describe(
            "Read every shard once: size and sha256 against the manifest, tar headers against the .idx and the "
            "manifest's sample counts (Arrow: row counts), duplicate keys; --decode also decodes image fields "
            "with PIL. Exits 1 and lists every problem (shard, sample key, byte offset) if any is found."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree verify ./in1k --decode\n  stallfree verify ./in1k --json",
    )
    v.add_argument("dataset", help="dataset directory (or its manifest.json): local path or fsspec URL")
    v.add_argument("--decode", action="store_true", help="also decode every image field with PIL")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    add_storage_option(v, "DATASET")
    v.set_defaults(func=run_verify)


def _field_size(value: Any) -> Any:
    """Bytes for binary/text fields; a short type description for the rest."""
    if isinstance(value, (bytes, str)):
        return len(value)
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"array{list(shape)} {value.dtype}"
    if isinstance(value, list):
        return f"list[{len(value)}]"
    return type(value).__name__


def run_inspect(args: argparse.Namespace) -> int:
    from stallfree.errors import ShardError
    from stallfree.shards.formats import get_format
    from stallfree.shards.open import open_dataset
    from stallfree.shards.scan import resolve

    try:
        options = storage_options(args)
    except ValueError as exc:
        return fail("inspect", exc, 2)
    try:
        ds = open_dataset(args.dataset, **options)
        # resolve says whether a manifest.json is there (paths None) or the shards were listed, so
        # open_dataset indexed them on the fly and its manifest is made up, version and all. After
        # open_dataset, so that a missing bucket or a refused read gets its own error.
        on_disk = resolve(args.dataset, **options)[2] is None
        manifest = ds.manifest
        first = ds[0] if len(ds) else {}
    except (ShardError, OSError, ValueError) as exc:
        return fail("inspect", exc)
    key = first.get("__key__")
    sizes = {f: _field_size(v) for f, v in first.items() if not f.startswith("__")}
    info = {
        "dataset": args.dataset,
        "format": manifest.format,
        "manifest": on_disk,
        "version": manifest.version if on_disk else None,
        "samples": manifest.samples,
        "shards": len(manifest.shards),
        "bytes": manifest.bytes,
        "fingerprint": manifest.fingerprint,
        "fields": manifest.fields,
        "field_types": manifest.field_types,
        "classes": manifest.classes,
        "skipped": len(manifest.skipped),
        "first_sample": {"key": key, "field_sizes": sizes},
        "shard_list": [s.to_json() for s in manifest.shards[: max(args.shards, 0)]],
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    n = manifest.samples
    print(f"dataset:     {args.dataset}")
    if on_disk:
        print(f"format:      {manifest.format} (manifest version {manifest.version})")
    else:
        indexable = get_format(manifest.format).indexable  # (index: tars only)
        fix = "stallfree index" if indexable else "stallfree shard"
        print(f"format:      {manifest.format} (no manifest.json: indexed on the fly; `{fix}` writes one)")
    print(f"samples:     {n:,} in {len(manifest.shards):,} shard(s)")
    avg = f", {manifest.bytes / n / 1e3:,.1f} KB/sample" if n else ""
    print(f"bytes:       {manifest.bytes:,} ({manifest.bytes / 1e6:,.1f} MB{avg})")
    types = manifest.field_types or {}
    print("fields:      " + ", ".join(f"{f} ({types[f]})" if f in types else f for f in manifest.fields))
    if manifest.classes is not None:
        shown = ", ".join(manifest.classes[:8]) + (", ..." if len(manifest.classes) > 8 else "")
        print(f"classes:     {len(manifest.classes):,} ({shown})")
    print(f"skipped:     {len(manifest.skipped):,} source item(s)")
    print(f"fingerprint: {manifest.fingerprint}")
    if key is not None:
        shown = ", ".join(f"{f} {v:,} B" if isinstance(v, int) else f"{f} {v}" for f, v in sizes.items())
        print(f"first sample {key!r}: {shown}")
    for s in manifest.shards[: max(args.shards, 0)]:
        print(f"  {s.path}  {s.samples:,} samples  {s.bytes:,} B  sha256 {(s.sha256 or '-')[:16]}")
    if len(manifest.shards) > args.shards > 0:
        print(f"  ... and {len(manifest.shards) - args.shards:,} more shard(s)")
    return 0


def _read_in_place_as(dataset: str, options: dict[str, Any]) -> str | None:
    """What ``dataset`` is when ``open_dataset`` reads it in place from an ``index.json`` (its
    format's name for people: ``MDS``, ``LitData``), else None. Why: verify checks shards against
    a manifest, which these have none of; without this it advised ``stallfree index`` (tars only)
    or, given the ``index.json``, took it for a manifest of an unknown version."""
    import posixpath

    from stallfree.shards import formats
    from stallfree.shards.scan import resolve
    from stallfree.storage import remote
    from stallfree.storage.jsonfile import parse_json

    if dataset.endswith("manifest.json"):
        return None
    fs, _, paths = resolve(dataset, **options)
    if paths is None or len(paths) != 1 or posixpath.basename(paths[0]) != "index.json":
        return None
    index = parse_json(remote.read_file(fs, paths[0], shard="index.json"), paths[0])
    for fmt in formats.read_only_formats():
        if fmt.accepts(index):  # type: ignore[attr-defined]
            return fmt.what  # type: ignore[attr-defined]
    return None


def run_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from stallfree.errors import ShardError
    from stallfree.shards.verify import total_bytes, verify_dataset

    try:
        options = storage_options(args)
    except ValueError as exc:
        return fail("verify", exc, 2)
    try:
        in_place = _read_in_place_as(args.dataset, options)
    except (ShardError, OSError, ValueError):  # nothing there, or unreadable: verify reports it
        in_place = None
    if in_place is not None:
        return fail(
            "verify",
            f"{args.dataset} is a {in_place} dataset, read in place: it has no manifest.json with "
            f"sizes and digests to verify against. `stallfree shard {args.dataset} DST` reads every "
            "sample (damage is an error naming the file, sample and offset) and writes shards with a "
            "manifest; `stallfree verify DST` then checks them",
        )
    try:
        with tqdm(
            total=total_bytes(args.dataset, **options),
            unit="B",
            unit_scale=True,
            desc="verifying",
            file=sys.stderr,
            disable=args.no_progress,
        ) as bar:
            report = verify_dataset(args.dataset, decode=args.decode, progress=bar.update, **options)
    except (ShardError, OSError, ValueError) as exc:
        return fail("verify", exc)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        decoded = f", decoded {report.decoded:,} image(s)" if args.decode else ""
        print(
            f"checked {report.shards:,} shard(s), {report.samples:,} samples, {report.bytes:,} bytes{decoded}: "
            + ("OK" if report.ok else f"{len(report.problems)} problem(s)")
        )
        for p in report.problems:
            where = [f"shard {p.shard}" if p.shard else None, f"key {p.key!r}" if p.key else None]
            where.append(f"offset {p.offset}" if p.offset is not None else None)
            print(f"  {p.error}: " + ", ".join(w for w in where if w) + f": {p.message}")
    return 0 if report.ok else 1

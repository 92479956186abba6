"""``stallfree staging list`` and ``stallfree staging clear``: the node-local staging area (whole
shards of remote datasets copied to local disk for block order; ``docs/staging.md``)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from stallfree.cli._common import describe, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "staging",
        help="list or clear the node-local staging area (shards of remote datasets copied to local disk)",
        description=describe(
            "The loader copies whole shards of a remote dataset read in block order into a staging "
            "area on local disk, one directory per dataset fingerprint, shared by every process of the "
            "node and kept across runs (up to its cap). These commands show what it holds and free it."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n  stallfree staging list\n  stallfree staging list --root /scratch/stage --json\n"
            "  stallfree staging clear --older-than 7\n  stallfree staging clear --dataset 3f2a9c..."
        ),
    )
    ssub = p.add_subparsers(dest="staging_command", metavar="ACTION")
    ls = ssub.add_parser(
        "list",
        help="datasets staged: fingerprint, URL, size, file count, last use",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_root(ls)
    ls.add_argument("--json", action="store_true", help="print the list as JSON on stdout")
    ls.set_defaults(func=run_list)
    clear = ssub.add_parser(
        "clear",
        help="delete staged copies (never one a running loader is reading or writing)",
        description=describe(
            "Delete staged copies: all of them, or those not used for --older-than DAYS, or one "
            "dataset's (--dataset FINGERPRINT, as `stallfree staging list` shows it). A copy a process "
            "is reading or writing is kept (it takes the locks staging takes); an emptied dataset "
            "directory is removed."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_root(clear)
    clear.add_argument(
        "--older-than", type=float, default=None, metavar="DAYS", help="only copies unused for DAYS days"
    )
    clear.add_argument("--dataset", default=None, metavar="FINGERPRINT", help="only this dataset's copies")
    clear.add_argument("--json", action="store_true", help="print what was done as JSON on stdout")
    clear.set_defaults(func=run_clear)
    p.set_defaults(func=lambda args: _usage(p))


def _add_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root",
        default=None,
        metavar="DIR",
        help="the staging directory (default: stallfree-staging-<uid> in the temp directory, as the loader's)",
    )


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _root(args: argparse.Namespace) -> str:
    from stallfree.storage.staging import default_root

    return args.root or default_root()


def run_list(args: argparse.Namespace) -> int:
    from stallfree.storage.staging import StagingDirError
    from stallfree.storage.staging_admin import list_staging

    root = _root(args)
    try:
        spaces = list_staging(root)
    except (StagingDirError, OSError) as exc:
        return fail("staging list", exc)
    if args.json:
        print(json.dumps({"root": root, "datasets": [asdict(s) for s in spaces]}, indent=2))
        return 0
    if not spaces:
        print(f"{root}: nothing staged")
        return 0
    print(f"{root}: {len(spaces)} dataset(s), {_size(sum(s.bytes for s in spaces))}")
    print(f"{'FINGERPRINT':34} {'SIZE':>10} {'FILES':>6}  {'LAST USE':19}  URL")
    for s in spaces:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.last_use)) if s.last_use else "-"
        print(f"{s.fingerprint:34} {_size(s.bytes):>10} {s.files:>6}  {used:19}  {s.url or '(not recorded)'}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from stallfree.storage.staging import StagingDirError
    from stallfree.storage.staging_admin import clear_staging

    if args.older_than is not None and args.older_than < 0:
        return fail("staging clear", f"--older-than must be >= 0 days, got {args.older_than}", 2)
    root = _root(args)
    older = None if args.older_than is None else args.older_than * 86400.0
    try:
        done = clear_staging(root, older_than_s=older, dataset=args.dataset)
    except KeyError:
        return fail(
            "staging clear", f"no dataset {args.dataset} staged in {root} (see `stallfree staging list`)"
        )
    except (StagingDirError, OSError) as exc:
        return fail("staging clear", exc)
    if args.json:
        print(json.dumps({"root": root, **asdict(done)}, indent=2))
        return 0
    line = f"{root}: removed {done.removed_files} file(s), {_size(done.removed_bytes)}"
    if done.kept_in_use:
        line += f"; kept {done.kept_in_use} file(s) in use, {_size(done.kept_bytes)}"
    print(line)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"

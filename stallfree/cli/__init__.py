"""The ``stallfree`` command line: one sub-module per subcommand, imported lazily.

Each sub-module exposes ``register(subparsers)`` (adds its parser, cheap: no heavy imports) and a
``run(args) -> int`` set as the parser's ``func``. This package is the only code that prints or
reads environment variables.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from stallfree import __version__

# subcommand name -> module under stallfree.cli
_COMMANDS = {
    "shard": "shard",
    "index": "shard",
    "inspect": "inspect",
    "verify": "inspect",
    "bench": "bench",
    "cache": "cache",
    "demo": "demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stallfree",
        description="Input-pipeline accelerator for PyTorch training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree shard ./imagenet/train ./in1k-shards --format tar --workers 4",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    parser.add_argument(
        "-V",
        "--version",
        action="version",
        version=f"stallfree {__version__}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in dict.fromkeys(_COMMANDS.values()):
        try:
            module = importlib.import_module(f"stallfree.cli.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"stallfree.cli.{module_name}":
                continue  # subcommand not built in this checkout
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

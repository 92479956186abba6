"""The ``stallfree`` command line: one sub-module per subcommand, imported lazily.

Each sub-module exposes ``register(subparsers)`` (adds its parser, cheap: no heavy imports) and a
``run(args) -> int`` set as the parser's ``func``. This package is the only code that prints or
reads environment variables.

``main`` ends every command the same way: a missing optional dependency is one line naming the
extra to install (``stallfree.extras.MissingExtra``), never a traceback; output into a pipe the
reader closed (``stallfree inspect ... | head``) ends quietly with 141, as a shell's own tools do.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
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
    "doctor": "doctor",
    "staging": "staging",
    "trace": "trace",
    "audit": "audit",
}

# the exit status of a process killed by SIGPIPE in a shell (128 + 13): what `set -o pipefail`
# scripts and `head` users expect from a writer whose reader went away
EXIT_BROKEN_PIPE = 141


class _VersionAction(argparse.Action):
    """``--version``: stallfree's version, torch's, and the JPEG decoder this install uses and why
    (computed when asked, so building the parser imports neither torch nor the decoder)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from stallfree.cli.doctor import version_lines

        print("\n".join(version_lines()))
        sys.stdout.flush()  # a closed pipe raises here, for main to end quietly
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stallfree",
        description="Input-pipeline accelerator for PyTorch training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree shard ./imagenet/train ./in1k --format tar --workers 4",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    parser.add_argument(
        "-V",
        "--version",
        action=_VersionAction,
        help=f"print the version (stallfree {__version__}), torch's, and the JPEG decoder in use, and exit",
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
    try:
        return _main(argv)
    except BrokenPipeError:
        return _closed_pipe()


def _main(argv: list[str] | None) -> int:
    from stallfree.extras import missing_extra_of

    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:  # MissingExtra, or a library's own ImportError for a missing extra
        missing = missing_extra_of(exc)
        if missing is None:
            raise
        print(f"stallfree {_command_of(args)}: error: {missing}", file=sys.stderr)
        return 1


def _command_of(args: argparse.Namespace) -> str:
    """``cache stats`` for a group's subcommand (its parser's dest is ``<group>_command``), else the
    subcommand's name."""
    action = getattr(args, f"{args.command}_command", None)
    return " ".join(str(v) for v in (args.command, action) if v)


def _closed_pipe() -> int:
    """The reader of stdout went away (``| head``): no traceback, and none at exit either, where
    Python would flush the dead stdout again and print "Exception ignored ... BrokenPipeError"."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured by a test)
        pass
    return EXIT_BROKEN_PIPE

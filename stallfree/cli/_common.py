"""Small helpers the subcommand modules share (argument parsing, error lines)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any


def describe(*paragraphs: str, width: int = 92) -> str:
    """A subcommand's ``description=``: each paragraph filled to ``width`` columns.

    The parsers use ``RawDescriptionHelpFormatter`` so that epilog examples keep their line
    breaks; that formatter leaves descriptions unwrapped too, so they are filled here."""
    return "\n\n".join(textwrap.fill(" ".join(p.split()), width, break_on_hyphens=False) for p in paragraphs)


def parse_key_value(text: str, what: str = "option") -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, true/false), else a string.

    Raises ValueError naming ``what`` (e.g. "storage option") when there is no ``=`` or no key.
    """
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{what} must be KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_storage_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``-o/--storage-option KEY=VALUE`` (repeatable), the same flag on every subcommand that opens
    a URL: fsspec options for ``what`` (e.g. s3fs's ``endpoint_url``, ``anon=true``)."""
    parser.add_argument(
        "-o",
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"fsspec storage option for {what} (value parsed as JSON when it can be), repeatable",
    )


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``-o`` pairs as a dict; ValueError naming the malformed one."""
    return dict(parse_key_value(pair, "storage option") for pair in args.storage_option)


def fail(command: str, message: object, code: int = 1) -> int:
    """Print ``stallfree COMMAND: error: MESSAGE`` to stderr and return the exit code.

    An error whose advice names a Python argument is re-worded with the command's flag
    (``DatasetExistsError``: ``overwrite=True`` -> ``--overwrite``)."""
    from stallfree.errors import DatasetExistsError  # imports nothing else of ours

    if isinstance(message, DatasetExistsError):
        message = message.advice("--overwrite")
    print(f"stallfree {command}: error: {message}", file=sys.stderr)
    return code

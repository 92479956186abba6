"""``stallfree audit DIR``: was every sample of each epoch delivered exactly once? (the delivery
record of ``DataLoader(record_keys=DIR)``; ``stallfree.trace.audit``)."""

from __future__ import annotations

import argparse
import json

from stallfree.cli._common import describe, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit",
        help="check a delivery record (record_keys=DIR): every sample once per epoch across ranks and resumes",
        description=describe(
            "Read the per-rank delivery record a DataLoader(record_keys=DIR) wrote and check that every "
            "position of each epoch was delivered exactly once across ranks, resumes (a resume rolls back "
            "what the killed run delivered after its checkpoint), world-size changes and skipped steps. "
            "Exits 1 and names the first violation (a duplicate, with every rank and step that got it, "
            "or a lost sample) if there is one; an epoch still running is checked up to where it got."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree audit ./runs/exp1/keys\n  stallfree audit ./runs/exp1/keys --json",
    )
    p.add_argument("directory", help="the record_keys= directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallfree.trace.audit import audit

    try:
        report = audit(args.directory)
    except (OSError, ValueError) as exc:
        return fail("audit", exc)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
        return 0 if report.ok else 1
    print(f"{report.files} record file(s), {report.runs} run(s)")
    for epoch, c in sorted(report.epochs.items()):
        state = "complete" if c["complete"] else "in progress"
        print(
            f"  epoch {epoch} ({state}): {c['delivered']} of {c['n']} positions delivered, {c['skipped']} "
            f"skipped, {c['duplicates']} duplicated, {c['lost']} lost"
        )
    for name in report.truncated:
        print(f"  {name}: its last record was cut short (a killed run); the rest is read")
    if report.ok:
        print("ok: every position delivered exactly once")
        return 0
    print(f"FIRST VIOLATION: {report.first}")
    return 1

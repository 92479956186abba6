"""``stallfree trace STATE --step S``: the samples of a training step, from a saved loader state
and the dataset, computed, not looked up in a log (``stallfree.loader.epoch.samples``)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from stallfree.cli._common import add_storage_option, describe, fail, storage_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="list the samples of any training step's batch, from a saved loader state",
        description=describe(
            "Compute which samples a training step's batch held on a rank (position, index and, where "
            "the dataset tells, mixture source, shard, key, packed documents with token offsets) from "
            "a loader state saved with loader.state_dict() and the dataset it was saved for. Nothing "
            "is logged at training time: the order is a function of the state's seed, and the state "
            "carries the run's steps, world sizes and skips. A step after the state's is the one its "
            "run went on to read (the same world size, no further skips).",
            "A sharded dataset is opened from where the state says it was opened (or --data, when it "
            "moved); a dataset built in code is named with --dataset MODULE:FUNCTION (a function "
            "returning it, e.g. the mixture your training script builds; the current directory is "
            "importable) and its arguments as --dataset-arg.",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example:\n  stallfree trace ckpt/loader.json --step 1200\n"
            "  stallfree trace ckpt/loader.json --step 1200 --rank 3 --json \\\n"
            "      --dataset train:make_mixture --dataset-arg ./data"
        ),
    )
    p.add_argument("state", help="a JSON file: one loader's state_dict(), or stallfree_loader_state.json")
    p.add_argument(
        "--step", type=int, required=True, help="the training step (batches per rank since the run began)"
    )
    p.add_argument("--rank", type=int, default=0, help="the rank whose batch to list (default 0)")
    p.add_argument(
        "--loader", type=int, default=0, help="which loader of a state file holding several (default 0)"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--data",
        help="a sharded dataset (directory, manifest.json or fsspec URL); default: the one the state names",
    )
    where.add_argument("--dataset", help="MODULE:FUNCTION returning the dataset the state was saved for")
    p.add_argument(
        "--dataset-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for --dataset's function (repeat)",
    )
    p.add_argument("--json", action="store_true", help="print the batch as JSON on stdout")
    add_storage_option(p, "--data")
    p.set_defaults(func=run)


def _state(path: str, loader: int) -> dict[str, Any]:
    from stallfree.storage.jsonfile import read_json

    doc = read_json(path)
    if isinstance(doc, dict) and isinstance(doc.get("loaders"), list):  # the integrations' state file
        states = doc["loaders"]
        if not 0 <= loader < len(states):
            raise ValueError(f"{path} holds {len(states)} loader state(s); --loader {loader} is not one")
        doc = states[loader]
    if not isinstance(doc, dict):
        raise ValueError(f"{path} holds no loader state (a JSON object)")
    return doc


def _dataset(args: argparse.Namespace, state: dict[str, Any]) -> Any:
    url = args.data
    if url is None and args.dataset is None:
        url = state.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError(
                "the state names no dataset it was opened from (a dataset built in code, or a state saved "
                "before stallfree recorded it): pass --data URL or --dataset MODULE:FUNCTION"
            )
    if url is not None:
        from stallfree.shards.open import open_dataset

        return open_dataset(url, **storage_options(args))
    module_name, sep, attr = args.dataset.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--dataset takes MODULE:FUNCTION, got {args.dataset!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the training script's directory, as `python -m` would
    factory = getattr(importlib.import_module(module_name), attr)
    if not callable(factory):
        if args.dataset_arg:
            raise ValueError(f"--dataset-arg given, but {args.dataset} is not a function")
        return factory
    return factory(*args.dataset_arg)


def run(args: argparse.Namespace) -> int:
    from stallfree.loader.epoch.samples import trace_state

    try:
        state = _state(args.state, args.loader)
        dataset = _dataset(args, state)
        found = trace_state(state, dataset, args.step, args.rank)
    except (OSError, ValueError, ImportError, AttributeError) as exc:
        return fail("trace", exc)
    if args.json:
        print(json.dumps(found.to_dict(), indent=1))
        return 0
    print(
        f"step {found.step}: epoch {found.epoch}, batch {found.batch} of rank {found.rank} "
        f"(world size {found.world_size}), {len(found.samples)} samples"
    )
    for first, end in found.skips:
        print(f"  (steps {first}..{end - 1} of the run that skipped them were left out)")
    for s in found.samples:
        parts = [f"position {s.position}", f"index {s.index}"]
        if s.source is not None:
            parts.append(f"source {s.source}[{s.source_index}]")
        if s.shard is not None:
            parts.append(f"shard {s.shard} row {s.row}")
        if s.key is not None:
            parts.append(f"key {s.key}")
        if s.documents:
            docs = ", ".join(f"doc {d.doc} tokens {d.offset}..{d.offset + d.tokens - 1}" for d in s.documents)
            parts.append(f"{s.token_source or 'tokens'}: {docs}")
        if s.padded:
            parts.append("(padding)")
        print("  " + "  ".join(parts))
    return 0

"""Child process of ``test_arrow_fuzz.py``: damages a table file many ways and reads it back.

A crash here (SIGSEGV, SIGABRT) would kill the test run, so the parent runs this script in a
subprocess and reads one JSON line per case: ``{"case": n, "start": ...}`` before the case (so a
crash names it) and ``{"case": n, "outcome": ...}`` after. Usage::

    python arrow_fuzz_child.py SPEC_JSON

SPEC: ``target`` (``"shard"``: a stallfree Arrow dataset directory read through
``open_dataset``; ``"hf"``: a Hugging Face style ``.arrow`` stream read through ``open_dataset``
and through the sharding source ``open_source``), ``original`` (the undamaged file), ``work``
(a directory for damaged copies; for ``shard`` the dataset directory whose shard is replaced),
``seed``, ``first``, ``count``.

Every outcome must be: the rows come back equal to the original's, or a typed error
(``ShardError``) whose message names the file. A row that comes back different is reported as
``changed`` with the byte range that was damaged; the parent decides whether that damage can
explain it (the row's own batch: bytes no structural check can tell from data).
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
from typing import Any

faulthandler.enable()

from stallfree.errors import ShardError  # noqa: E402
from stallfree.shards.open import open_dataset  # noqa: E402

SPECIAL = (0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFF8, 0x00000000, 0x00010000)


def mutate(data: bytes, rng: random.Random, case: int) -> tuple[bytes, str, int, int]:
    """One deterministic damage: ``(damaged bytes, what, first byte changed, end of change)``."""
    out = bytearray(data)
    kind = case % 4
    if kind == 0:  # bit flips, 1 to 4 of them, close together
        at = rng.randrange(len(out))
        spots = sorted({min(len(out) - 1, at + rng.randrange(64)) for _ in range(rng.randint(1, 4))})
        for p in spots:
            out[p] ^= 1 << rng.randrange(8)
        return bytes(out), f"flip bits at {spots}", spots[0], spots[-1] + 1
    if kind == 1:  # cut short
        n = rng.randrange(len(out))
        return bytes(out[:n]), f"truncate to {n} bytes", n, len(data)
    width = 4 if kind == 2 else 8  # a length or offset field overwritten
    p = rng.randrange(0, len(out) - width) & ~(width - 1)
    if width == 4:
        value = rng.choice(SPECIAL + (rng.randrange(1 << 32),))
    else:
        value = rng.choice(((1 << 63) - 1, 1 << 40, (1 << 64) - 8, rng.randrange(1 << 64)))
    out[p : p + width] = value.to_bytes(width, "little")
    return bytes(out), f"overwrite {width} bytes at {p} with {value:#x}", p, p + width


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if hasattr(v, "tolist") or hasattr(w, "tolist"):
            if not (hasattr(v, "tolist") and hasattr(w, "tolist") and v.tolist() == w.tolist()):
                return False
        elif v != w:
            return False
    return True


def typed(exc: BaseException, name: str) -> dict[str, Any] | None:
    """None when ``exc`` is the error we promise (typed, names the file), else what it was."""
    if isinstance(exc, ShardError) and name in str(exc):
        return None
    return {"type": type(exc).__name__, "message": str(exc)[:300]}


def _count(result: dict[str, Any], problem: dict[str, Any] | None, rows: int = 1) -> None:
    if problem is None:
        result["typed"] += rows
    else:
        result["bad"].append(problem)


def read_dataset(url: str, name: str, expected: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """Every row of ``open_dataset(url)``: counts of equal rows, typed errors, and the indices of
    changed rows; ``bad`` holds any error that is not typed or does not name ``name``."""
    result: dict[str, Any] = {"equal": 0, "typed": 0, "changed": [], "changed_like": [], "bad": []}
    try:
        ds = open_dataset(url, **options)
    except Exception as exc:  # noqa: BLE001 - classified below
        _count(result, typed(exc, name), len(expected))
        return result
    if len(ds) != len(expected):
        result["bad"].append({"type": "length", "message": f"{len(ds)} rows, expected {len(expected)}"})
        return result
    for i in range(len(ds)):
        try:
            row = ds[i]
        except Exception as exc:  # noqa: BLE001 - classified below
            _count(result, typed(exc, name))
            continue
        if same(row, expected[i]):
            result["equal"] += 1
        else:
            result["changed"].append(i)
            # another row's content served as this one (a block pointing at another batch)
            result["changed_like"] += [j for j, e in enumerate(expected) if j != i and same(row, e)]
    return result


def read_source(path: str, name: str, expected: list[dict[str, Any]]) -> dict[str, Any]:
    """The file as ``stallfree shard`` reads it (``open_source``, skipping what fails)."""
    from stallfree.shards.sources.registry import open_source

    result: dict[str, Any] = {"equal": 0, "typed": 0, "changed": [], "changed_like": [], "bad": []}
    by_key = {e["__key__"]: e for e in expected}
    try:
        src = open_source(path, on_error="skip")
        items = src.items()
        got = list(src.read_many(items))
    except Exception as exc:  # noqa: BLE001 - classified below
        _count(result, typed(exc, name))
        return result
    for entry in src.skipped:
        if name not in entry["source"]:
            result["bad"].append({"type": "skipped", "message": str(entry)})
        else:
            result["typed"] += 1
    for sample in got:
        if isinstance(sample, Exception):
            _count(result, typed(sample, name))
            continue
        want = by_key.get(sample["__key__"])
        if want is not None and same(sample, want):
            result["equal"] += 1
        else:
            result["changed"].append(sample["__key__"])
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    original = open(spec["original"], "rb").read()  # noqa: SIM115 - read once
    name = os.path.basename(spec["original"])
    work = spec["work"]
    if spec["target"] == "shard":
        target = os.path.join(work, name)
        expected = [dict(s) for s in open_dataset(work)]
    else:
        target = os.path.join(work, name)
        with open(target, "wb") as f:
            f.write(original)
        expected = [dict(s) for s in open_dataset(target)]
        source_expected = list(_source_rows(target))
    for case in range(spec["first"], spec["first"] + spec["count"]):
        rng = random.Random(f"{spec['seed']}:{spec['target']}:{case}")
        data, what, lo, hi = mutate(original, rng, case)
        print(json.dumps({"case": case, "start": what}), flush=True)
        with open(target, "wb") as f:
            f.write(data)
        out: dict[str, Any] = {"case": case, "what": what, "lo": lo, "hi": hi, "size": len(data)}
        if spec["target"] == "shard":
            out["read"] = read_dataset(work, name, expected)
            if out["read"]["changed"]:  # what the manifest's sha256 is for
                out["hashed"] = read_dataset(work, name, expected, verify_hashes=True)
        else:
            out["read"] = read_dataset(target, name, expected)
            out["source"] = read_source(target, name, source_expected)
        print(json.dumps(out), flush=True)
    with open(target, "wb") as f:
        f.write(original)


def _source_rows(path: str):
    from stallfree.shards.sources.registry import open_source

    src = open_source(path)
    yield from src.read_many(src.items())


if __name__ == "__main__":
    main()

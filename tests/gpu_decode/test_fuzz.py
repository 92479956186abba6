"""Seeded mutation fuzzing of header.probe and the CPU decoders (C and PIL), in a subprocess.

Every mutated file must end one of three ways: refused by probe (BadImageError), decoded, or a
per-sample BatchDecodeError naming it; never another exception, a crash or a hang. The seeds make
each run the same cases, so a failure here reproduces with the same seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.zygote import AS_SCRIPT, run_python

CHILD = Path(__file__).with_name("fuzz_child.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", [1, 2])
def test_mutated_images_are_refused_or_decoded_never_crash(seed):
    # ``python fuzz_child.py ARGS``, forked from the test zygote (torch imported once)
    proc = run_python(AS_SCRIPT, str(CHILD), json.dumps({"seed": seed, "cases": 200}), timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["unexpected"] == [], "\n".join(out["unexpected"][:5])
    counts = out["counts"]
    # the mutations reach both sides: refusals by the header, and decodes (clean or refused)
    assert counts["probe_refused"] >= 20 and counts["decoded"] >= 20, counts

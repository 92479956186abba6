"""Child process for test_fuzz.py: seeded mutations of small real images through header.probe and
the CPU decoders (C and PIL); prints one JSON line of what happened. A subprocess, so that a crash
in C (a segfault, an abort) or a hang fails the test by its exit status or timeout, not pytest.

argv[1]: JSON {"seed": int, "cases": int}.
"""

from __future__ import annotations

import io
import json
import sys
import traceback

import numpy as np

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode.header import BadImageError, probe
from stallfree.gpu_decode.select import ImageDecode
from stallfree.testing.images import base_photos, make_image


def corpus(rng: np.random.Generator) -> list[bytes]:
    """Small but real: baseline 4:2:0 and 4:4:4, progressive, grey, restart markers, EXIF, PNG."""
    photos = base_photos()
    out = []
    for mode, kw in [
        ("RGB", {"quality": 80}),
        ("RGB", {"quality": 95, "subsampling": 0}),
        ("RGB", {"progressive": True}),
        ("L", {"progressive": True}),
        ("RGB", {"restart_marker_blocks": 1}),
        (
            "RGB",
            {
                "exif": b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x01\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00"
            },
        ),
    ]:
        buf = io.BytesIO()
        make_image(rng, photos, (72, 56), mode).save(buf, format="JPEG", **kw)
        out.append(buf.getvalue())
    buf = io.BytesIO()
    make_image(rng, photos, (40, 30)).save(buf, format="PNG")
    out.append(buf.getvalue())
    return out


def mutate(rng: np.random.Generator, data: bytes) -> bytes:
    b = bytearray(data)
    kind = int(rng.integers(6))
    if kind == 0:  # flip a few bytes anywhere
        for _ in range(int(rng.integers(1, 9))):
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
    elif kind == 1:  # bytes in the headers (most of them in the first few hundred)
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(min(len(b), 700)))] = int(rng.integers(256))
    elif kind == 2:  # truncate
        b = b[: int(rng.integers(len(b)))]
    elif kind == 3:  # duplicate a slice (a repeated scan, a repeated segment)
        lo = int(rng.integers(len(b)))
        hi = min(len(b), lo + int(rng.integers(1, 400)))
        at = int(rng.integers(len(b)))
        b[at:at] = b[lo:hi] * int(rng.integers(1, 6))
    elif kind == 4:  # a marker byte pair where there was data
        at = int(rng.integers(len(b) - 1))
        b[at : at + 2] = bytes(
            [0xFF, int(rng.choice([0xC0, 0xC2, 0xC4, 0xD9, 0xDA, 0xDB, 0xDD, 0xFF, 0x00]))]
        )
    else:  # a 16-bit field (a length, a size) set to an extreme
        at = int(rng.integers(min(len(b), 700) - 1))
        b[at : at + 2] = int(rng.choice([0, 1, 0xFFFF, 0x8000])).to_bytes(2, "big")
    return bytes(b)


def main() -> None:
    args = json.loads(sys.argv[1])
    rng = np.random.default_rng(args["seed"])
    seeds = corpus(rng)
    decoders = {
        lib: ImageDecode(
            train=True,
            size=24,
            backend="cpu",
            jpeg_library=lib,
            num_threads=1,
            dtype="uint8",
            label_field=False,
        )
        for lib in ("turbo", "pil")
    }
    counts = {"probe_refused": 0, "decoded": 0, "decode_refused": 0}
    unexpected: list[str] = []
    for case in range(args["cases"]):
        data = mutate(rng, seeds[case % len(seeds)])
        try:
            probe(data)
        except BadImageError:
            counts["probe_refused"] += 1
            continue
        except Exception:  # anything but BadImageError from probe is a bug
            unexpected.append(f"case {case} probe: {traceback.format_exc(limit=3)}")
            continue
        for lib, dec in decoders.items():
            try:
                out = dec.decode_batch([{"__key__": f"c{case}", "jpg": data}], seed=case)
                assert out["image"].shape == (1, 3, 24, 24)
                counts["decoded"] += 1
            except BatchDecodeError as exc:
                assert [key for _, key, _ in exc.failures] == [f"c{case}"]
                counts["decode_refused"] += 1
            except Exception:
                unexpected.append(f"case {case} {lib}: {traceback.format_exc(limit=3)}")
    print(json.dumps({"counts": counts, "unexpected": unexpected}))


if __name__ == "__main__":
    main()

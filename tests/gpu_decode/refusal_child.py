"""Child process for test_limits.py: one epoch of the real DataLoader over a shard holding refused
images; prints what came out as one JSON line (run in a subprocess so that a decoder that does not
refuse, and instead spends minutes and gigabytes on a bomb, fails the test by its timeout).

argv[1]: JSON {"url", "backend", "device", "on_error", "num_workers", "max_pixels" (absent: the default)}.
"""

from __future__ import annotations

import json
import logging
import resource
import sys

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode.select import ImageDecode
from stallfree.loader.dataloader import DataLoader
from stallfree.shards.open import open_dataset


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    args = json.loads(sys.argv[1])
    warnings = _Lines()
    logging.getLogger().addHandler(warnings)
    limit = {"max_pixels": args["max_pixels"]} if "max_pixels" in args else {}
    ds = open_dataset(args["url"])
    dec = ImageDecode(
        train=False, size=32, backend=args["backend"], device=args["device"], num_threads=2, **limit
    )
    loader = DataLoader(
        ds,
        batch_size=len(ds),
        shuffle=False,
        decode=dec,
        on_error=args["on_error"],
        max_failures=len(ds),
        num_workers=args["num_workers"],
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict = {"keys": [], "error": None, "error_keys": []}
    try:
        for batch in loader:
            out["keys"] += batch["__key__"]
    except BatchDecodeError as exc:
        out["error"] = str(exc)
        out["error_keys"] = [key for _, key, _ in exc.failures]
        out["causes"] = [str(cause) for _, _, cause in exc.failures]
    if out["error"] is None:
        out["failed_keys"] = sorted(loader.stats()["failed_keys"])
    out["warnings"] = warnings.lines
    # ru_maxrss is in KiB on Linux; what the epoch added to the process's peak.
    out["rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Child process for test_limits.py: one epoch of the real DataLoader over a shard holding refused
images; prints what came out as one JSON line (run in a subprocess so that a decoder that does not
refuse, and instead spends minutes and gigabytes on a bomb, fails the test by its timeout).

argv[1]: JSON {"url", "backend", "device", "on_error", "num_workers", "max_pixels" (absent: the default)},
or a list of them: one epoch each, in turn, in this one process (the interpreter, torch and the decoder
are imported once, not once per epoch: about 1.7 CPU-s a process); then one JSON list. Each epoch's
``rss_growth_mib`` is measured from its own start: the kernel's peak-RSS mark is reset before each one
(``/proc/self/clear_refs``), so a later epoch's growth is not hidden under an earlier epoch's peak.
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


def _peak_rss_kib() -> int:
    """The process's peak resident set size (VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Set the peak-RSS mark to the current RSS (Linux >= 4.0), so the next reading is this epoch's;
    False where the kernel does not let this process (then the mark is the peak so far)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def epoch(args: dict) -> dict:
    """One epoch of the loader over ``args["url"]`` configured by ``args``: what came out."""
    warnings = _Lines()
    logging.getLogger().addHandler(warnings)
    try:
        return _epoch(args, warnings)
    finally:
        logging.getLogger().removeHandler(warnings)


def _epoch(args: dict, warnings: _Lines) -> dict:
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
    peak_reset = _reset_peak_rss()
    rss_before = _peak_rss_kib()
    out: dict = {"keys": [], "error": None, "error_keys": [], "peak_reset": peak_reset}
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
    # what the epoch added to the process's peak, from its reset at the epoch's start
    out["rss_growth_mib"] = (_peak_rss_kib() - rss_before) / 1024
    return out


def main() -> None:
    args = json.loads(sys.argv[1])
    out = [epoch(one) for one in args] if isinstance(args, list) else epoch(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

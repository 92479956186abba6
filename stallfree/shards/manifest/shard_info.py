"""``ShardInfo``: one shard's row in a manifest (path, sample count, size, hash, stamp).

Its own module so that both ways of reading a manifest's shard table (``manifest.json`` and
the binary sidecar, ``manifest_sidecar.py``) can build it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stallfree.errors import ManifestError


@dataclass(frozen=True)
class ShardInfo:
    """One shard: ``path`` (relative to the manifest's directory), sample count, size, sha256 hex.

    ``sha256`` is None when unknown (a dataset indexed on the fly, without reading whole shards).
    ``xxh3_128`` is the fast digest of the same bytes, what a fetched copy is checked against
    (``digests.py``); None in manifests written before it was recorded (copies are then checked
    against the sha256), and not written then.
    ``stamp`` is what identifies the content of a shard indexed on the fly without a sha256: the
    store's version of the file and its index's hash (``stamps.py``); it is part of the dataset's
    fingerprint, so a shard changed in place changes it. None (and not written) otherwise.
    """

    path: str
    samples: int
    bytes: int
    sha256: str | None = None
    stamp: str | None = None
    xxh3_128: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"path": self.path, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256}
        if self.stamp is not None:
            out["stamp"] = self.stamp
        if self.xxh3_128 is not None:
            out["xxh3_128"] = self.xxh3_128
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "manifest") -> ShardInfo:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: shard entry must be an object, got {type(obj).__name__}")
        try:
            path, samples, size = obj["path"], obj["samples"], obj["bytes"]
        except KeyError as exc:
            raise ManifestError(f"{where}: shard entry lacks {exc.args[0]!r}: {obj!r}") from None
        sha = obj.get("sha256")
        if not isinstance(path, str) or not path:
            raise ManifestError(f"{where}: shard path must be a non-empty string: {obj!r}")
        for name, value in (("samples", samples), ("bytes", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ManifestError(
                    f"{where}: shard {path}: {name} must be a non-negative integer: {value!r}"
                )
        if sha is not None and not (isinstance(sha, str) and len(sha) == 64):
            raise ManifestError(f"{where}: shard {path}: sha256 must be 64 hex digits or null: {sha!r}")
        stamp = obj.get("stamp")
        if stamp is not None and not isinstance(stamp, str):
            raise ManifestError(f"{where}: shard {path}: stamp must be a string or null: {stamp!r}")
        fast = obj.get("xxh3_128")
        if fast is not None and not _is_hex(fast, 32):
            raise ManifestError(f"{where}: shard {path}: xxh3_128 must be 32 hex digits or null: {fast!r}")
        return cls(path, samples, size, sha, stamp, fast)


def _is_hex(value: Any, digits: int) -> bool:
    if not isinstance(value, str) or len(value) != digits:
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return True

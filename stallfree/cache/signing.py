"""HMAC-SHA256 signatures on cluster cache entries, bound to the cache key they are stored under.

A Redis server is shared by every process that can reach it; a password keeps strangers out, a
signature keeps out anyone without the secret even where the password is known or absent. The
MAC covers the key as well as the value, so a genuine entry copied under another key (another
sample's slot) fails too. Layout: ``b"SFsg" | mac (32 bytes) | codec blob``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MARK = b"SFsg"
_MAC_SIZE = hashlib.sha256().digest_size
OVERHEAD = len(MARK) + _MAC_SIZE
_MIN_SECRET_BYTES = 16


class EntrySigner:
    """Signs entries on the way into the cluster and opens them on the way out."""

    def __init__(self, secret: bytes | str) -> None:
        key = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
        if len(key) < _MIN_SECRET_BYTES:
            raise ValueError(f"the cache secret must be at least {_MIN_SECRET_BYTES} bytes, got {len(key)}")
        self._key = key

    def _mac(self, key: bytes, blob: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, struct.pack("<I", len(key)), hashlib.sha256)
        mac.update(key)
        mac.update(blob)
        return mac.digest()

    def sign(self, key: bytes, blob: bytes) -> bytes:
        return b"".join([MARK, self._mac(key, blob), blob])

    def open(self, key: bytes, stored: bytes) -> tuple[bytes | None, str]:
        """``(blob, "")`` for an entry signed for ``key`` with our secret, else ``(None, why)``."""
        if len(stored) < OVERHEAD or stored[: len(MARK)] != MARK:
            return None, "unsigned entry"
        view = memoryview(stored)
        blob = view[OVERHEAD:]
        if not hmac.compare_digest(self._mac(key, blob), bytes(view[len(MARK) : OVERHEAD])):
            return None, "bad signature (another secret, another key, or a forged entry)"
        return blob.tobytes(), ""

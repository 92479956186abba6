"""manifest_rows: the fingerprint text equals json.dumps character for character."""

from __future__ import annotations

import hashlib
import json

from stallfree.shards.manifest.model import Manifest, ShardInfo
from stallfree.shards.manifest.rows import fingerprint_text

_ENTRIES = [
    {"path": "a.tar", "samples": 10, "bytes": 1000, "sha256": "0" * 64},
    {"path": 'we"ird\\näme €.tar', "samples": 0, "bytes": 0, "sha256": None},
    {"path": "s/x.tar", "samples": 2**40, "bytes": 2**50, "sha256": None, "stamp": "v1:abc\u2603"},
    {"path": "f.tar", "samples": 3, "bytes": 30, "sha256": "1" * 64, "xxh3_128": "ab" * 16},
    {"path": "g.tar", "samples": 3, "bytes": 30, "sha256": None, "stamp": "s", "xxh3_128": "cd" * 16},
]


def test_fingerprint_text_is_json_dumps_character_for_character():
    shards = [ShardInfo.from_json(e) for e in _ENTRIES]
    for fields in ([], ["jpg", "cls"], ["ünï", 'q"']):
        body = {"version": 1, "format": "tar", "fields": fields, "shards": [s.to_json() for s in shards]}
        want = json.dumps(body, sort_keys=True, separators=(",", ":"))
        assert fingerprint_text(1, "tar", fields, shards) == want
    m = Manifest(version=1, format="arrow", fields=["x"], shards=shards)
    body = {"version": 1, "format": "arrow", "fields": ["x"], "shards": [s.to_json() for s in shards]}
    plain = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    assert m.fingerprint == plain  # caches keyed by it stay valid

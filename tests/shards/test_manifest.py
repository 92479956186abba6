import json

import pytest

from stallfree.shards.errors import ManifestError, MissingShardError
from stallfree.shards.manifest import FORMAT_VERSION, Manifest, ShardInfo


def _manifest() -> Manifest:
    return Manifest(
        version=FORMAT_VERSION,
        format="tar",
        fields=["cls", "jpg"],
        shards=[
            ShardInfo("shard-000000.tar", 3, 10240, "a" * 64),
            ShardInfo("shard-000001.tar", 2, 8192, None),
        ],
        classes=["cat", "dog"],
    )


def test_round_trip_local(tmp_path):
    m = _manifest()
    path = m.save(str(tmp_path))
    assert path.endswith("manifest.json")
    back = Manifest.load(str(tmp_path))
    assert back == m
    assert back.samples == 5 and back.bytes == 18432
    assert back.fingerprint == m.fingerprint


def test_round_trip_memory_fs():
    m = _manifest()
    m.save("memory://mtest/ds")
    assert Manifest.load("memory://mtest/ds/manifest.json") == m


def test_fingerprint_depends_on_content():
    a, b = _manifest(), _manifest()
    b.shards[0] = ShardInfo("shard-000000.tar", 3, 10240, "b" * 64)
    assert a.fingerprint != b.fingerprint
    assert len(a.fingerprint) == 32 and int(a.fingerprint, 16) >= 0


def test_unknown_version_names_file(tmp_path):
    obj = _manifest().to_json()
    obj["version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match=r"unknown manifest format version 99") as info:
        Manifest.load(str(tmp_path))
    assert str(tmp_path / "manifest.json") in str(info.value)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda o: o.update(format="zip"), "unknown shard format 'zip'"),
        (lambda o: o.update(fields="jpg"), "'fields' must be a list"),
        (lambda o: o["shards"][0].pop("samples"), "lacks 'samples'"),
        (lambda o: o["shards"][0].update(bytes=-1), "bytes must be a non-negative integer"),
        (lambda o: o["shards"][0].update(sha256="xyz"), "sha256 must be 64 hex digits"),
    ],
)
def test_malformed_fields(tmp_path, mutate, message):
    obj = _manifest().to_json()
    mutate(obj)
    (tmp_path / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match=message):
        Manifest.load(str(tmp_path / "manifest.json"))


def test_not_json_and_missing(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(str(tmp_path))
    with pytest.raises(MissingShardError, match="no manifest"):
        Manifest.load(str(tmp_path / "nothere"))


def test_extra_keys_survive(tmp_path):
    obj = _manifest().to_json()
    obj["source"] = "imagefolder"
    (tmp_path / "manifest.json").write_text(json.dumps(obj))
    m = Manifest.load(str(tmp_path))
    assert m.extra == {"source": "imagefolder"}
    assert m.to_json()["source"] == "imagefolder"

"""Cluster entries are not trusted: planted with a raw redis client on a real redis-server, a
hostile, ill-typed, misplaced or unsigned entry is a miss, is deleted, and the real sample is read."""

from __future__ import annotations

import pickle
import struct
import zlib

import numpy as np
import pytest

from stallfree.cache import codec
from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache
from stallfree.cache.credentials import CredentialFileError
from stallfree.cache.readthrough import read_through
from stallfree.loader.dataloader import DataLoader
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter

SECRET = "s3cret-s3cret-s3cret-s3cret"


def raw_client(server):
    import redis

    return redis.Redis(host=server.host, port=server.port, password=server.password)


def deep_json_entry(key: str) -> bytes:
    """A dict entry with a correct header and CRC whose JSON field is nested 200,000 deep."""
    fields = [(b"__key__", "s", key.encode()), (b"meta", "j", b"[" * 200_000 + b"]" * 200_000)]
    body = struct.pack("<I", len(fields))
    for name, tag, value in fields:
        body += struct.pack("<H", len(name)) + name + struct.pack("<BQ", ord(tag), len(value)) + value
    return struct.pack("<4sBBHIQ", b"SFcv", codec.VERSION, 3, 0, zlib.crc32(body), len(body)) + body


@pytest.fixture
def tar_ds(tmp_path):
    with ShardWriter(tmp_path / "tar", format="tar", max_samples=3) as w:
        for i in range(6):
            w.write({"__key__": f"s{i}", "jpg": bytes([i]) * 50, "cls": str(i % 2).encode()})
    return open_dataset(str(tmp_path / "tar"))


def plain(sample: dict) -> dict:
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def truth(ds, indices) -> list[dict]:
    return [plain(s) for s in ds.get_many(indices)]


def rkey(ds, i: int) -> bytes:
    return CacheKey(ds.fingerprint, i, "raw").to_bytes()


def test_deep_json_entry_is_a_miss_not_a_recursion_error_and_is_deleted(redis_servers):
    (server,) = redis_servers(1)
    cache = ClusterCache([server.url])
    key = CacheKey("fp", 1, "raw")
    raw_client(server).set(key.to_bytes(), deep_json_entry("s1"))
    assert cache.get_many([key, CacheKey("fp", 2, "raw")]) == [None, None]
    assert cache.stats()["corrupt"] == 1 and cache.stats()["errors"] == 0
    assert raw_client(server).exists(key.to_bytes()) == 0


@pytest.mark.parametrize(
    "planted, reason",
    [
        (b"just bytes", "is a dict of fields, the entry holds bytes"),
        (np.arange(3), "the entry holds ndarray"),
        ({"jpg": b"x", "cls": b"1"}, "'__key__' must be a non-empty str, the entry has None"),
        ({"__key__": 7, "jpg": b"x"}, "'__key__' must be a non-empty str, the entry has 7"),
        ({"__key__": "", "jpg": b"x"}, "'__key__' must be a non-empty str"),
        ({"__key__": "s1", "jpg": 12345}, "field 'jpg' is int, the dataset gives bytes"),
        ({"__key__": "s1", "jpg": [1, 2]}, "field 'jpg' is list, the dataset gives bytes"),
        ({"__key__": "s1", "jpg": b"x", "exe": b"MZ"}, "field 'exe' is not one of the dataset's fields"),
    ],
    ids=["bytes", "array", "no-key", "int-key", "empty-key", "int-field", "json-field", "extra-field"],
)
def test_ill_typed_entry_is_a_miss_deleted_and_replaced_by_the_real_sample(
    redis_servers, tar_ds, planted, reason, caplog
):
    (server,) = redis_servers(1)
    cache = ClusterCache([server.url])
    raw_client(server).set(rkey(tar_ds, 1), codec.encode(planted))
    with caplog.at_level("WARNING"):
        got = read_through(tar_ds, [0, 1, 2], cache)
    assert [plain(s) for s in got] == truth(tar_ds, [0, 1, 2])
    assert reason in caplog.text
    assert cache.stats()["corrupt"] == 1
    # deleted, then refilled from storage with the real sample
    assert codec.decode(raw_client(server).get(rkey(tar_ds, 1))) == truth(tar_ds, [1])[0]
    assert [plain(s) for s in read_through(tar_ds, [1], cache)] == truth(tar_ds, [1])
    assert cache.stats()["hits"] == 1


class KeyedDataset:
    """The tar dataset, plus ``key_of``: its keys known without reading (as an index in memory)."""

    def __init__(self, ds) -> None:
        self.ds, self.manifest, self.fingerprint = ds, ds.manifest, ds.fingerprint

    def key_of(self, index: int) -> str:
        return f"s{index}"

    def get_many(self, indices):
        return self.ds.get_many(indices)


def test_a_genuine_entry_under_another_samples_key_is_rejected_where_the_dataset_knows_keys(
    redis_servers, tar_ds
):
    (server,) = redis_servers(1)
    cache = ClusterCache([server.url])
    read_through(tar_ds, [2], cache)
    client = raw_client(server)
    client.set(rkey(tar_ds, 1), client.get(rkey(tar_ds, 2)))  # sample s2's entry in s1's slot
    assert [s["__key__"] for s in read_through(KeyedDataset(tar_ds), [1, 2], cache)] == ["s1", "s2"]
    assert cache.stats()["corrupt"] == 1
    assert codec.decode(client.get(rkey(tar_ds, 1)))["__key__"] == "s1"


def test_arrow_entries_are_checked_per_column_type(redis_servers, tmp_path):
    with ShardWriter(tmp_path / "arrow", format="arrow") as w:
        for i in range(3):
            w.write({"__key__": f"a{i}", "cls": i, "txt": f"t{i}", "ids": np.arange(i + 1, dtype=np.int32)})
    ds = open_dataset(str(tmp_path / "arrow"))
    (server,) = redis_servers(1)
    cache = ClusterCache([server.url])
    first = read_through(ds, [0, 1, 2], cache)
    assert [s["__key__"] for s in read_through(ds, [0, 1, 2], cache)] == ["a0", "a1", "a2"]
    assert cache.stats()["hits"] == 3 and cache.stats()["corrupt"] == 0  # genuine entries pass
    client = raw_client(server)
    client.set(rkey(ds, 0), codec.encode({**first[0], "cls": "zero"}))  # a str where int64 is
    client.set(rkey(ds, 1), codec.encode({**first[1], "ids": [1, 2]}))  # a list where an array is
    got = read_through(ds, [0, 1], cache)
    assert got[0]["cls"] == 0 and isinstance(got[1]["ids"], np.ndarray)
    assert cache.stats()["corrupt"] == 2


def test_loader_with_on_error_skip_delivers_every_sample_past_a_hostile_entry(redis_servers, tar_ds):
    (server,) = redis_servers(1)
    cache = ClusterCache([server.url])
    raw_client(server).set(rkey(tar_ds, 4), deep_json_entry("s4"))
    loader = DataLoader(
        tar_ds,
        batch_size=2,
        cache=cache,
        seed=3,
        on_error="skip",
        collate_fn=lambda b: [s["__key__"] for s in b],
    )
    for _ in range(2):  # before: s4 was skipped every epoch and its entry never deleted
        assert sorted(k for batch in loader for k in batch) == [f"s{i}" for i in range(6)]
    assert codec.decode(raw_client(server).get(rkey(tar_ds, 4))) == truth(tar_ds, [4])[0]


# -- signed entries ------------------------------------------------------------------------------


def forged(ds, i: int) -> bytes:
    """What a local process without the secret can plant: well-typed, with the right key and the
    identity a genuine entry for that key carries (all of it public)."""
    value = {"__key__": f"s{i}", "jpg": b"FORGED", "cls": b"9"}
    return codec.encode(value, identity=CacheKey(ds.fingerprint, i, "raw").identity(value))


def test_without_a_secret_a_well_formed_planted_sample_is_delivered(redis_servers, tar_ds):
    """The threat the secret answers: type checks cannot tell a forged sample from a real one."""
    (server,) = redis_servers(1)
    raw_client(server).set(rkey(tar_ds, 1), forged(tar_ds, 1))
    assert read_through(tar_ds, [1], ClusterCache([server.url]))[0]["jpg"] == b"FORGED"


def test_with_a_secret_an_unsigned_planted_sample_is_a_miss_and_deleted(redis_servers, tar_ds, caplog):
    (server,) = redis_servers(1)
    cache = ClusterCache([server.url], secret=SECRET)
    client = raw_client(server)
    client.set(rkey(tar_ds, 1), forged(tar_ds, 1))
    with caplog.at_level("WARNING"):
        assert [plain(s) for s in read_through(tar_ds, [0, 1], cache)] == truth(tar_ds, [0, 1])
    assert "unsigned entry" in caplog.text
    assert cache.stats()["corrupt"] == 1
    stored = client.get(rkey(tar_ds, 1))  # refilled, signed
    assert stored.startswith(b"SFsg") and b"FORGED" not in stored
    # a pickled copy (a worker) keeps the secret and reads the signed entries
    clone = pickle.loads(pickle.dumps(cache))
    assert [plain(s) for s in read_through(tar_ds, [0, 1], clone)] == truth(tar_ds, [0, 1])
    assert clone.stats()["hits"] == 2


def test_signatures_bind_the_key_and_the_secret(redis_servers, tar_ds, tmp_path):
    (server,) = redis_servers(1)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    cache = ClusterCache([server.url], secret_file=secret_file)
    read_through(tar_ds, [2], cache)
    client = raw_client(server)
    client.set(rkey(tar_ds, 1), client.get(rkey(tar_ds, 2)))  # a genuine signed entry, moved
    cache.get_many([CacheKey(tar_ds.fingerprint, 1, "raw")])
    assert client.exists(rkey(tar_ds, 1)) == 0 and cache.stats()["corrupt"] == 1
    other = ClusterCache([server.url], secret="another-secret-of-enough-bytes")
    assert other.get_many([CacheKey(tar_ds.fingerprint, 2, "raw")]) == [None]
    assert client.exists(rkey(tar_ds, 2)) == 0


def test_bad_secret_and_password_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="at least 16 bytes, got 5"):
        ClusterCache(["127.0.0.1:1"], secret="short")
    with pytest.raises(ValueError, match="a secret or a secret_file, not both"):
        ClusterCache(["127.0.0.1:1"], secret=SECRET, secret_file=tmp_path / "s")
    with pytest.raises(ValueError, match="a password or a password_file, not both"):
        ClusterCache(["127.0.0.1:1"], password="pw", password_file=tmp_path / "p")
    with pytest.raises(CredentialFileError, match="cannot read password file .*/missing"):
        ClusterCache(["127.0.0.1:1"], password_file=tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CredentialFileError, match="password file .*/empty is empty"):
        ClusterCache(["127.0.0.1:1"], password_file=tmp_path / "empty")


def test_password_file_reaches_a_server_that_requires_it(redis_servers, tmp_path):
    import redis

    (server,) = redis_servers(1, password="pw-from-file")
    (tmp_path / "pw").write_text("pw-from-file\n")
    (tmp_path / "pw").chmod(0o600)
    cache = ClusterCache([server.url], password_file=tmp_path / "pw")
    cache.put_many([(CacheKey("fp", 1, "raw"), b"v")])
    assert cache.get_many([CacheKey("fp", 1, "raw")]) == [b"v"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=server.host, port=server.port).set(b"sf/x", b"planted")

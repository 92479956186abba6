import json

import pytest

from stallfree.errors import ManifestError, MissingShardError
from stallfree.shards.manifest.model import FORMAT_VERSION, Manifest, ShardInfo


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


def test_deeply_nested_json_is_a_manifest_error_naming_the_file(tmp_path):
    """100,000 nested arrays made ``json.loads`` raise RecursionError (issue 36 item 13)."""
    from stallfree.shards.open import open_dataset

    path = tmp_path / "manifest.json"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text('{"version": 1, "format": "tar", "fields": [], "shards": [], "skipped": ' + deep + "}")
    with pytest.raises(ManifestError, match="nested too deeply") as err:
        Manifest.load(str(tmp_path))
    assert str(path) in str(err.value)
    with pytest.raises(ManifestError) as err:
        open_dataset(str(tmp_path))
    assert str(path) in str(err.value)


_WRONG_VALUES = (None, -1, "x", [], {}, 1.5, True, 2**70, "../../../etc/passwd", [[[]]], {"a": None}, "")


def _paths(obj, prefix=()):
    """Every place in a JSON value (keys of objects, indices of arrays), depth first."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _fuzzed_manifest(text: str, case: int) -> bytes:
    """Case ``case`` of 300: a truncation, flipped bytes, or a value of another type."""
    import random

    rng = random.Random(f"manifest:{case}")
    data = bytearray(text.encode())
    kind = case % 3
    if kind == 0:
        return bytes(data[: rng.randrange(len(data))])
    if kind == 1:
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    obj = json.loads(text)
    places = [p for p in _paths(obj) if p]
    place = rng.choice(places)
    parent = obj
    for part in place[:-1]:
        parent = parent[part]
    parent[place[-1]] = rng.choice(_WRONG_VALUES)
    return json.dumps(obj).encode()


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_fuzzed_manifests_give_typed_errors_naming_the_file(request, fmt):
    """300 seeded cases through ``open_dataset`` and every sample: each outcome is the right
    samples, or a ShardError whose message names the manifest or the shard file it is about
    (11 of 300 named no file, and ``"samples": 2**70`` was an OverflowError)."""
    from stallfree.errors import ShardError
    from stallfree.shards.open import open_dataset

    root = request.getfixturevalue(f"{fmt}_dataset")
    path = root / "manifest.json"
    text = path.read_text()
    expected = [dict(s) for s in open_dataset(str(root))]
    untyped, nameless = [], []
    for case in range(300):
        path.write_bytes(_fuzzed_manifest(text, case))
        try:
            ds = open_dataset(str(root))
            got = [dict(ds[i]) for i in range(len(ds))]
            assert got == expected, case
        except ShardError as exc:
            message = str(exc)
            # the manifest, or the shard file the error is about (one its entry names)
            if str(path) not in message and not (exc.shard and str(exc.shard) in message):
                nameless.append((case, message))
        except Exception as exc:  # noqa: BLE001 - what the test is for
            untyped.append((case, f"{type(exc).__name__}: {exc}"))
    path.write_text(text)
    assert (untyped, nameless) == ([], [])


# a manifest from elsewhere pointed reads at any file: join() keeps absolute paths and URLs, and
# lets ".." climb out (a dataset whose one shard was ../secret/shard-000000.tar served its rows)
_OUTSIDE = [
    ("/etc/passwd", "is absolute"),
    ("../secret/shard-000000.tar", "climbs out of the dataset directory"),
    ("sub/../../secret.tar", "climbs out of the dataset directory"),
    ("file:///etc/passwd", "is a URL"),
    ("s3://another-bucket/shard.tar", "is a URL"),
    ("sub\\..\\..\\x.tar", "holds a backslash"),
]


@pytest.mark.parametrize(("path", "problem"), _OUTSIDE)
def test_a_shard_path_out_of_the_dataset_is_refused_naming_the_entry(tmp_path, path, problem):
    from stallfree.shards.open import open_dataset

    m = _manifest()
    m.shards[1] = ShardInfo(path, 2, 8192, None)
    text = m.dumps()
    (tmp_path / "manifest.json").write_text(text)
    for load in (lambda: Manifest.load(str(tmp_path)), lambda: open_dataset(str(tmp_path))):
        with pytest.raises(ManifestError) as err:
            load()
        message = str(err.value)
        assert f"shard 1 ({path!r}) {problem}" in message and str(tmp_path / "manifest.json") in message
        assert err.value.shard == path


def test_paths_inside_the_dataset_still_load(tmp_path):
    m = _manifest()
    m.shards[0] = ShardInfo("train/part..1/shard-000000.tar", 3, 10240, None)  # '..' inside a name
    m.shards[1] = ShardInfo("./train/shard-000001.tar", 2, 8192, None)
    m.save(str(tmp_path))
    assert Manifest.load(str(tmp_path)) == m


def test_sample_counts_that_add_up_past_int64_are_refused(tmp_path):
    """Each count fits an int64, the sum does not: ``len()`` of the dataset was an
    ``OverflowError`` naming nothing."""
    m = _manifest()
    m.shards[0] = ShardInfo("shard-000000.tar", 2**62, 10240, None)
    m.shards[1] = ShardInfo("shard-000001.tar", 2**62, 8192, None)
    (tmp_path / "manifest.json").write_text(m.dumps())
    with pytest.raises(ManifestError, match="its shards hold 9223372036854775808 samples in all") as err:
        Manifest.load(str(tmp_path))
    assert str(tmp_path / "manifest.json") in str(err.value)


def test_an_integer_of_thousands_of_digits_is_a_manifest_error(tmp_path):
    """``json.loads`` refuses integers of more than 4,300 digits with a plain ``ValueError``
    (no ``.msg``): reading the error was an ``AttributeError`` naming nothing."""
    (tmp_path / "manifest.json").write_text(
        '{"version": 1, "format": "tar", "fields": [], "shards": [], "n": ' + "7" * 5000 + "}"
    )
    with pytest.raises(ManifestError, match="not valid JSON: Exceeds the limit") as err:
        Manifest.load(str(tmp_path))
    assert str(tmp_path / "manifest.json") in str(err.value)

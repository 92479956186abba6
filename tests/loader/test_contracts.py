"""Contracts, not probes (issue 23.2): what the loader asks of the objects it is handed is asked
in stallfree/loader/contracts.py only, through protocols; ``decode=`` is resolved once.

Before: ~49 ``hasattr`` / ``getattr(x, "name")`` probes over nine loader modules answered the
same questions several times, slightly differently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.utils.data as tud

from stallfree import ImageDecode
from stallfree.cache import MemoryCache
from stallfree.loader import contracts
from stallfree.loader.contracts import DecodePlacement, place_decode

LOADER = Path(__file__).resolve().parents[2] / "stallfree" / "loader"
# contracts.py asks; _torch_compat.py reads torch's own private names (tests/test_imports.py)
EXEMPT = {"contracts.py", "_torch_compat.py"}


def _probes(path: Path) -> list[str]:
    """``hasattr(...)`` calls and ``getattr(obj, "constant", ...)`` calls (a name by string)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name = node.func.id
        by_string = len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
        if name == "hasattr" or (name == "getattr" and by_string):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_probes_outside_contracts():
    found = [p for f in sorted(LOADER.glob("*.py")) if f.name not in EXEMPT for p in _probes(f)]
    assert found == [], "ask through stallfree/loader/contracts.py:\n" + "\n".join(found)


def test_the_probe_finder_finds_probes(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a = hasattr(x, 'y')\nb = getattr(x, 'z', None)\nc = getattr(x, name)\n")
    assert [p.split(": ", 1)[1] for p in _probes(f)] == ["hasattr(x, 'y')", "getattr(x, 'z', None)"]


# -- decode= resolved once ----------------------------------------------------------------------
class MainDecoder:
    def decode_batch(self, samples, *, seed):
        return samples


class WorkerDecoder(MainDecoder):
    runs_in_workers = True

    def use_threads(self, n: int) -> None:
        self.threads = n


class Finishing(MainDecoder):
    needs_finish = True

    def finish(self, batch):
        return batch


class Staged:
    cache_stage = "small"

    def __call__(self, sample):
        return sample


def per_sample(sample):
    return sample


@pytest.mark.parametrize(
    "decode, workers, where",
    [
        (None, 2, "none"),
        (per_sample, 2, "sample"),
        (per_sample, 0, "sample"),
        (MainDecoder(), 2, "main"),
        (WorkerDecoder(), 2, "workers"),
        (WorkerDecoder(), 0, "main"),  # no workers: the main process decodes
        (Finishing(), 2, "main"),
    ],
)
def test_decode_placement_table(decode, workers, where):
    p = place_decode(decode, workers)
    assert p.where == where
    assert p.map_fn is (decode if where == "sample" else None)
    assert p.in_workers is (decode if where == "workers" else None)
    assert p.in_main is (decode if where == "main" else None)
    assert p.send_raw == (where == "main") and p.batch == (where in ("main", "workers"))
    assert (p.threaded is not None) == (where == "workers")


def test_decode_placement_derived_fields():
    assert place_decode(Staged(), 1).cache_stage == "small"
    assert place_decode(per_sample, 1).cache_stage is None
    fin = Finishing()
    assert place_decode(fin, 2).finish == fin.finish and place_decode(MainDecoder(), 2).finish is None
    cpu = ImageDecode(train=False, size=32, backend="cpu")
    assert place_decode(cpu, 2).where == ("workers" if cpu.runs_in_workers else "main")


def test_decode_must_be_a_decoder():
    with pytest.raises(TypeError, match="decode= must be a callable"):
        place_decode(42, 1)
    with pytest.raises(ValueError, match="placement"):
        DecodePlacement("gpu")


# -- the dataset protocols ----------------------------------------------------------------------
class Sharded(tud.Dataset):
    fingerprint = "abc"
    shard_sizes = [2, 2]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"i": i}

    def get_many(self, indices):
        return [self[i] for i in indices]


class Mixture(Sharded):
    ordered = True

    def set_epoch(self, epoch):
        self.epoch = epoch


class NotOrdered(Mixture):
    ordered = False


def test_dataset_protocols():
    assert contracts.is_sharded(Sharded()) and not contracts.is_sharded([1, 2])
    assert contracts.orders_itself(Mixture()) and not contracts.orders_itself(NotOrdered())
    assert contracts.fingerprint_of(Sharded()) == "abc" and contracts.fingerprint_of([1]) is None
    assert contracts.batch_read_of([1]) is None and contracts.collated_read_of(Sharded()) is None
    assert isinstance(MemoryCache(capacity_bytes=1 << 20), contracts.Cache)
    assert contracts.key_of(Sharded(), 1) is None  # no key_of: not known


def test_key_of_never_raises():
    class Broken(Sharded):
        def key_of(self, index):
            raise OSError("index unreadable")

    assert contracts.key_of(Broken(), 1) is None

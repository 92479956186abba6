"""Writes an MDS dataset with ``mosaicml-streaming``'s ``MDSWriter`` (gz-compressed shards, and
raw ones) and a LitData dataset with ``litdata.optimize``: run in ``.venv-formats``
(``scripts/formats_env.sh``) by ``test_inplace_writers.py``, never imported by the test suite.

``streaming/__init__.py`` imports its vision datasets (torchvision, which ``.venv-formats`` does not
have); the writer's own modules do not, so the package is entered without running that file."""

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np

N = 20
MDS_COLUMNS = {"image": "jpeg", "label": "int", "caption": "str", "emb": "ndarray:float32:2,3",
               "arr": "ndarray", "score": "float32", "meta": "json", "flag": "uint8"}  # fmt: skip


def mds_row(i: int) -> dict:
    return {"image": b"\xff\xd8" + bytes([i]) * (300 + i), "label": i, "caption": f"c{i} \u00fc",
            "emb": np.full((2, 3), i, np.float32), "arr": np.arange(i + 1, dtype=np.int16),
            "score": i / 3, "meta": {"i": i, "tags": ["a"] * (i % 3)}, "flag": i % 2}  # fmt: skip


def lit_row(i: int) -> dict:
    return {"index": i, "image": b"\xff\xd8" + bytes([i]) * 200, "name": f"n{i}",
            "arr": np.arange(i + 1, dtype=np.uint8), "pair": (i * 0.5, i % 2 == 0),
            **lit_lists(i)}  # fmt: skip


def lit_lists(i: int) -> dict:
    """Lists in a sample: litdata stores each as one ``json`` leaf (its binary nested form)."""
    return {"tags": [f"t{i} \u00fc", "x"], "ids": list(range(i % 4)), "scores": [i * 0.5, -1.0],
            "flags": [True, i % 2 == 0], "recs": [{"a": i, "b": f"r{i}", "c": None}, {"a": -i, "b": "", "c": 1.5}],
            "mixed": [i, "s", None, {"k": [1, 2]}]}  # fmt: skip


def write_mds(out: Path, compression: str | None) -> None:
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = package
    from streaming.base.format.mds.writer import MDSWriter

    with MDSWriter(out=str(out), columns=MDS_COLUMNS, compression=compression, size_limit=2500) as w:
        for i in range(N):
            w.write(mds_row(i))


def main() -> None:
    root = Path(sys.argv[1])
    write_mds(root / "mds-gz", "gz")
    write_mds(root / "mds-raw", None)
    from litdata import optimize

    optimize(fn=lit_row, inputs=list(range(N)), output_dir=str(root / "lit"), chunk_size=6, num_workers=1)


if __name__ == "__main__":  # (optimize's worker process imports this file again)
    main()

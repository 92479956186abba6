"""uint64 token ids: below 2**63 they are carried exactly into the int64 windows; at or above they
are an error naming the file, the document, the id and the byte offset (they used to wrap
negative). Rejected rather than carried: no vocabulary has 2**63 ids, so one is a misread file."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from stallfree.errors import CorruptShardError
from stallfree.tokens.packing import TokenDataset

TOP = 2**63 - 1


def _raw(tmp_path, docs, eot=7):
    ids = np.asarray([t for d in docs for t in [*d, eot]], np.uint64)
    ids.tofile(tmp_path / "wide.bin")
    return str(tmp_path / "wide.bin")


@pytest.mark.parametrize("eos", [None, 7])
def test_ids_below_two_to_the_63_are_carried_exactly(tmp_path, eos):
    path = _raw(tmp_path, [[1, TOP, 2], [TOP - 1, 3]])
    ds = TokenDataset(path, 3, dtype="uint64", eos=eos)
    got = [t for i in range(len(ds)) for t in ds[i]["input_ids"].tolist()]
    assert got == [1, TOP, 2, 7, TOP - 1, 3]


@pytest.mark.parametrize("eos", [None, 7])
def test_an_id_at_two_to_the_63_names_file_document_id_and_offset(tmp_path, eos):
    path = _raw(tmp_path, [[1, 2, 3], [4, 5], [6, 2**63 + 5, 8], [9, 10]])  # doc 2's id: token 8
    ds = TokenDataset(path, 4, dtype="uint64", eos=eos)
    assert ds[0]["input_ids"].tolist() == [1, 2, 3, 7]  # windows without it are fine
    with pytest.raises(CorruptShardError) as exc:
        ds.get_batch([0, 1, 2])
    err = exc.value
    assert err.shard == path and err.offset == 8 * 8
    doc = 2 if eos is not None else 0  # without eos a raw .bin is one document
    assert str(err) == (
        f"document {doc} holds token id {2**63 + 5} (token 8 of the source): uint64 ids must be below 2**63 "
        f"to fit the int64 windows (is the dtype right?) (shard {path}, byte offset 64)"
    )


def test_arrow_uint64_names_the_file(tmp_path):
    docs = [[1, 2, 3], [4, 2**64 - 1, 6]]
    t = pa.table({"input_ids": pa.array(docs, pa.list_(pa.uint64()))})
    path = tmp_path / "wide.arrow"
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    ds = TokenDataset(str(path), 2)
    with pytest.raises(CorruptShardError, match=f"document 1 holds token id {2**64 - 1} ") as exc:
        ds[1]
    assert exc.value.shard == str(path) and exc.value.offset is None

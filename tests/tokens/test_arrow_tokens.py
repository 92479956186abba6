"""Arrow / Parquet list-of-int columns read back token-exact: pyarrow-written IPC (file and
stream format), Parquet, Hugging Face ``datasets`` save_to_disk / to_parquet, our Arrow shards."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch

from stallfree.errors import ShardError
from stallfree.shards.writer import ShardWriter
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import check_windows, random_docs


def table(docs, typ=None):
    return pa.table(
        {
            "text": [f"doc {i}" for i in range(len(docs))],
            "input_ids": pa.array(docs, pa.list_(typ or pa.int32())),
        }
    )


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_arrow_ipc(tmp_path, kind):
    docs = random_docs(1)
    t = table(docs)
    path = tmp_path / "tok.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        writer = (ipc.new_file if kind == "file" else ipc.new_stream)(sink, t.schema)
        for batch in t.to_batches(max_chunksize=7):  # documents spread over several batches
            writer.write_batch(batch)
        writer.close()
    check_windows(TokenDataset(str(path), 6, eos=1), docs, 1)


def test_parquet_files_in_a_directory(tmp_path):
    docs = random_docs(2)
    pq.write_table(table(docs[:20], pa.int64()), tmp_path / "part-0.parquet", row_group_size=6)
    pq.write_table(table(docs[20:], pa.int64()), tmp_path / "part-1.parquet", row_group_size=6)
    check_windows(TokenDataset(str(tmp_path), 5), docs)
    check_windows(TokenDataset(str(tmp_path / "*.parquet"), 5), docs)


def test_other_field(tmp_path):
    docs = random_docs(3, n=10)
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.uint16()))}), tmp_path / "x.parquet")
    check_windows(TokenDataset(str(tmp_path / "x.parquet"), 4, field="tokens"), docs)
    with pytest.raises(ShardError, match="no column 'input_ids'"):
        TokenDataset(str(tmp_path / "x.parquet"), 4)


def test_not_a_token_column(tmp_path):
    pq.write_table(
        pa.table({"input_ids": pa.array([[0.5, 1.5]], pa.list_(pa.float32()))}), tmp_path / "f.parquet"
    )
    with pytest.raises(ShardError, match="list of integer token ids") as exc:
        TokenDataset(str(tmp_path / "f.parquet"), 1)
    assert exc.value.shard.endswith("f.parquet")


def test_our_arrow_shards(tmp_path):
    docs = random_docs(4, n=30)
    with ShardWriter(str(tmp_path / "ds"), format="arrow", max_samples=7) as w:
        for i, d in enumerate(docs):
            w.write({"__key__": f"{i:04d}", "input_ids": np.asarray(d, np.int32)})
    check_windows(TokenDataset(str(tmp_path / "ds"), 8, eos=0), docs, 0)


def test_hugging_face_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = [d for d in random_docs(5, n=30) if d]
    texts = [" ".join(map(str, d)) for d in docs]
    ds = datasets.Dataset.from_dict({"text": texts})
    tokenized = ds.map(lambda b: {"input_ids": [list(map(int, t.split())) for t in b["text"]]}, batched=True)
    tokenized.save_to_disk(str(tmp_path / "hf"), num_shards=3)
    check_windows(TokenDataset(str(tmp_path / "hf"), 6), docs)
    tokenized.to_parquet(str(tmp_path / "hf.parquet"))
    check_windows(TokenDataset(str(tmp_path / "hf.parquet"), 6), docs)


def test_unpickled_copy_opens_only_the_files_it_reads(tmp_path):
    import pickle

    docs = random_docs(6, n=40)
    for f in range(4):
        pq.write_table(table(docs[f * 10 : (f + 1) * 10]), tmp_path / f"p{f}.parquet")
    ds = TokenDataset(str(tmp_path), 4)
    copy = pickle.loads(pickle.dumps(ds))
    copy[0]
    assert [v is not None for v in copy.source._values].count(True) == len(
        [o for o in copy.source._owner if o == 0]
    )  # only the first file's pieces
    check_windows(copy, docs)


def test_files_of_different_int_types_and_windows_across_batches(tmp_path):
    """Read by pread from each file (and cast where a file's type is narrower than the dataset's)."""
    docs = random_docs(9, n=30, vocab=30000)
    for f, typ in enumerate([pa.uint16(), pa.int64()]):
        t = table(docs[f * 15 : (f + 1) * 15], typ)
        with pa.OSFile(str(tmp_path / f"p{f}.arrow"), "wb") as sink, ipc.new_file(sink, t.schema) as w:
            for batch in t.to_batches(max_chunksize=4):
                w.write_batch(batch)
    ds = TokenDataset(str(tmp_path), 7, eos=5)
    assert ds.source.dtype == np.int64 and len(ds.source._owner) == 8
    check_windows(ds, docs, 5)
    batch = ds.get_batch(list(range(len(ds))))
    assert all(
        torch.equal(batch[k].reshape(-1), torch.cat([ds[i][k] for i in range(len(ds))])) for k in batch
    )


@pytest.mark.parametrize("content", [b"not arrow at all", b"ARROW1\x00\x00truncated"])
def test_a_damaged_arrow_token_file_is_an_error_naming_it(tmp_path, content):
    # the layout is read off the file (arrow.reader.open_batches): no IPC file trailer, so
    # garbage and a file-format head cut short both go the stream way; both are errors naming
    # the file, never tokens
    from stallfree.errors import CorruptShardError
    from stallfree.tokens.arrow_tokens import ArrowTokenSource

    bad = tmp_path / "bad.arrow"
    bad.write_bytes(content)
    with pytest.raises(CorruptShardError, match="not a readable Arrow") as err:
        ArrowTokenSource(str(bad))
    assert err.value.shard == str(bad)


def _hf_dir(root, files):
    """A save_to_disk-like directory: a token stream file and a state.json listing ``files``."""
    import json

    root.mkdir()
    t = table(random_docs(6, n=5))
    with (
        pa.OSFile(str(root / "data-00000-of-00001.arrow"), "wb") as sink,
        ipc.new_stream(sink, t.schema) as w,
    ):
        w.write_table(t)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": f} for f in files]}))
    return root


@pytest.mark.parametrize(
    ("listed", "problem"),
    [
        ("../outside.arrow", "climbs out of the dataset directory"),
        ("/etc/passwd", "is absolute"),
        ("s3://other/x.arrow", "is a URL"),
        (7, "is not a file name"),
    ],
)
def test_a_state_json_naming_a_file_outside_is_refused(tmp_path, listed, problem):
    """state.json is data from elsewhere: it named any file for us to read as tokens."""
    (tmp_path / "outside.arrow").write_bytes(b"")
    root = _hf_dir(tmp_path / "hf", ["data-00000-of-00001.arrow", listed])
    with pytest.raises(ShardError, match=f"state.json lists {listed!r}, which {problem}") as exc:
        TokenDataset(str(root), 4)
    assert exc.value.shard == str(root / "state.json")


def test_a_state_json_file_linked_out_or_nested_deep_is_refused(tmp_path):
    docs = random_docs(7, n=5)
    t = table(docs)
    with pa.OSFile(str(tmp_path / "elsewhere.arrow"), "wb") as sink, ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    root = _hf_dir(tmp_path / "hf", ["data-00000-of-00001.arrow", "linked.arrow"])
    (root / "linked.arrow").symlink_to(tmp_path / "elsewhere.arrow")
    with pytest.raises(
        ShardError, match="linked.arrow is a symbolic link to .*outside the dataset directory"
    ):
        TokenDataset(str(root), 4)
    (root / "state.json").write_text('{"_data_files": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(ShardError, match="unreadable Hugging Face state.json: .*nested too deeply"):
        TokenDataset(str(root), 4)

"""Child process of ``test_arrow_tokens_fuzz.py``: damages a token Arrow file many ways and opens
it with ``ArrowTokenSource`` (the reader behind ``TokenDataset`` over ``.arrow``/``.parquet``).

A crash (SIGSEGV, SIGABRT) kills only this process; the parent reads one JSON line per case:
``{"case": n, "start": ...}`` before it (so a crash names it) and ``{"case": n, "outcome": ...}``
after. Usage::

    python arrow_tokens_fuzz_child.py KIND SEED FIRST COUNT WORKDIR

KIND: ``file`` (Arrow IPC file format), ``stream`` (IPC stream format, what Hugging Face
``save_to_disk`` writes) or ``parquet``. Every outcome must be the original tokens, tokens that
differ (a damaged token id is data: nothing structural tells it apart), or a ``ShardError``
naming the file; anything else is ``untyped``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
from pathlib import Path

faulthandler.enable()

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.ipc as ipc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shards"))
from arrow_fuzz_child import mutate  # noqa: E402

from stallfree.errors import ShardError  # noqa: E402
from stallfree.tokens.arrow_tokens import ArrowTokenSource  # noqa: E402


def write(kind: str, path: str, docs: list[list[int]]) -> None:
    table = pa.table(
        {"text": [f"doc {i}" for i in range(len(docs))], "input_ids": pa.array(docs, pa.list_(pa.int32()))}
    )
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=6)
        return
    with pa.OSFile(path, "wb") as sink:
        writer = (ipc.new_file if kind == "file" else ipc.new_stream)(sink, table.schema)
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
        writer.close()


def outcome(path: str, tokens: list[int]) -> str:
    try:
        source = ArrowTokenSource(path)
        got = source.read(0, int(source._starts[-1])).tolist()
    except ShardError as exc:
        return "typed" if os.path.basename(path) in str(exc) else f"unnamed {exc}"
    except Exception as exc:  # noqa: BLE001 - what the parent fails on
        return f"untyped {type(exc).__name__}: {str(exc)[:200]}"
    return "equal" if got == tokens else "changed"


def main() -> None:
    kind, seed, first, count, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, int(n)).tolist() for n in rng.integers(1, 30, 20)]
    path = os.path.join(work, "tokens." + ("parquet" if kind == "parquet" else "arrow"))
    write(kind, path, docs)
    original = Path(path).read_bytes()
    tokens = [t for d in docs for t in d]
    for case in range(first, first + count):
        data, what, _, _ = mutate(original, random.Random(f"{seed}:{kind}:{case}"), case)
        print(json.dumps({"case": case, "start": what}), flush=True)
        Path(path).write_bytes(data)
        print(json.dumps({"case": case, "what": what, "outcome": outcome(path, tokens)}), flush=True)


if __name__ == "__main__":
    main()

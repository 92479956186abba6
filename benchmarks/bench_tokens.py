"""Tokens/s delivered to the training loop, side by side on the same int32 tokens:

  stallfree  ``stallfree.DataLoader(TokenDataset(megatron_prefix, 2048), batch_size=16,
             num_workers=2, shuffle=True)``: packed windows with labels, position_ids, doc_ids
  nanogpt    nanoGPT's ``get_batch`` on a raw ``.bin`` (np.memmap, random offsets,
             ``torch.stack`` of ``x``/``y``) in the training process: the near-limit
  litdata    LitData ``StreamingDataset(item_loader=TokensLoader(block_size=2049))`` through
             ``StreamingDataLoader(batch_size=16, num_workers=2)`` on chunks LitData's own
             ``optimize`` wrote from the same tokens

Times exclude interpreter start and imports. The training loop reads one token per 4 KiB page of
each batch's inputs (a device copy touches every page: zero-copy batches must not look free). The Megatron ``.bin`` and the raw ``.bin`` are the same bytes (a hard link), so every contender
reads the same page-cached tokens. Each measurement runs in a fresh subprocess: ``--batches``
batches are timed after the first one (startup is reported as time to the first batch). Rounds
interleave the contenders, order reversed every other round; the best round counts (shared,
noisy machine). Also: time to the first batch on a ``--files``-file dataset (Arrow IPC files for
us, as many LitData chunks for LitData). LitData runs only where it is installed
(``bash benchmarks/env.sh``, then run with ``.venv-bench/bin/python``).

    .venv-bench/bin/python benchmarks/bench_tokens.py --tokens 64000000 --rounds 3

``--read-path``: instead of the contenders, our own two ways to read local token files, side by side
on the same windows: ``pread`` into a fresh array (what ``tokens/base.py`` ``FlatFile`` does) and
views of a memory map (what it did before, and what nanoGPT's ``np.memmap`` does; a file cut
short under the map is a SIGBUS). Both in this one process through ``TokenDataset.get_batch``
(the Megatron ``.bin`` with and without an ``eos`` between documents, and the ``--files`` Arrow
IPC files; the same random windows for both in a round), then through ``stallfree.DataLoader``
with 2 workers on the ``.bin``, each run in a fresh subprocess:

    .venv/bin/python benchmarks/bench_tokens.py --read-path --tokens 32000000 --files 1000 --batches 300 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SEQ, BATCH, WORKERS = 2048, 16, 2


def build(root: Path, tokens: int, files: int) -> None:
    """The token corpus in every contender's format (skips what exists)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from stallfree.tokens.megatron import MegatronWriter

    rng = np.random.default_rng(0)
    if not (root / "mega.idx").exists():
        with MegatronWriter(str(root / "mega"), dtype="int32") as w:
            left = tokens
            while left > 0:
                n = min(left, int(rng.integers(100, 4000)))
                w.write(rng.integers(0, 50000, n, dtype=np.int32))
                left -= n
        os.link(root / "mega.bin", root / "raw.bin")
    many = root / "many"
    if not many.exists():
        many.mkdir()
        for f in range(files):  # small Arrow IPC files, as a datasets.map(tokenize) cache holds
            docs = [rng.integers(0, 50000, int(k), dtype=np.int32) for k in rng.integers(100, 4000, 8)]
            t = pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32()))})
            with (
                pa.OSFile(str(many / f"part-{f:05d}.arrow"), "wb") as sink,
                ipc.new_file(sink, t.schema) as w,
            ):
                w.write_table(t)
    if _has_litdata():
        _build_litdata(root, files)


def _has_litdata() -> bool:
    try:
        import litdata  # noqa: F401
    except ImportError:
        return False
    return True


def _lit_fn(span):
    import torch

    path, lo, hi = span
    yield torch.from_numpy(np.array(np.memmap(path, np.int32, "r")[lo:hi]))


def _many_fn(path):
    import pyarrow.ipc as ipc
    import torch

    t = ipc.open_file(path).read_all()
    for d in t.column("input_ids").to_pylist():
        yield torch.tensor(d, dtype=torch.int32)


def _build_litdata(root: Path, files: int) -> None:
    from litdata import TokensLoader, optimize

    if not (root / "lit" / "index.json").exists():
        n = os.path.getsize(root / "raw.bin") // 4
        step = 1 << 20
        spans = [(str(root / "raw.bin"), lo, min(n, lo + step)) for lo in range(0, n, step)]
        optimize(
            fn=_lit_fn,
            inputs=spans,
            output_dir=str(root / "lit"),
            chunk_size=(SEQ + 1) * 8000,
            item_loader=TokensLoader(),
            num_workers=2,
            reorder_files=False,
        )
    if not (root / "lit_many" / "index.json").exists():
        parts = sorted(str(p) for p in (root / "many").iterdir())
        # one chunk per source file's worth of tokens (~16k): as many chunks as our files
        optimize(
            fn=_many_fn,
            inputs=parts,
            output_dir=str(root / "lit_many"),
            chunk_size=16_000,
            item_loader=TokensLoader(),
            num_workers=2,
            reorder_files=False,
        )


# -- contenders (each in its own process) -------------------------------------------------
def run_stallfree(root: Path, batches: int) -> dict:
    import stallfree
    from stallfree.loader import dataloader  # noqa: F401 - imports (torch) are not startup
    from stallfree.tokens import packing  # noqa: F401

    t0 = time.perf_counter()
    loader = stallfree.DataLoader(
        stallfree.TokenDataset(str(root / "mega"), SEQ),
        batch_size=BATCH,
        num_workers=WORKERS,
        shuffle=True,
        seed=0,
    )
    return _consume(iter(loader), batches, t0, lambda b: b["input_ids"])


class MmapSource:
    """Megatron tokens as views of a memory map: ``FlatFile``'s read path before it moved to
    ``pread``, kept here only to measure against. Picklable (a worker maps the file itself)."""

    def __init__(self, prefix: str) -> None:
        from stallfree.tokens.megatron import MegatronSource

        src = MegatronSource(prefix)
        self.prefix, self.name, self.dtype, self.doc_lengths = prefix, src.name, src.dtype, src.doc_lengths
        self.fingerprint = "mmap-" + src.fingerprint
        self._map: np.ndarray | None = None

    def read(self, start: int, stop: int) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.prefix + ".bin", self.dtype, "r")
        return self._map[start:stop]

    def read_runs(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:  # as FlatFile's
        out, at = np.empty(int(counts.sum()), self.dtype), 0
        for s, c in zip(starts.tolist(), counts.tolist(), strict=True):
            out[at : at + c] = self.read(s, s + c)  # one copy per window out of the mapping
            at += c
        return out

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}


def run_stallfree_mmap(root: Path, batches: int) -> dict:
    import stallfree
    from stallfree.loader import dataloader  # noqa: F401 - imports (torch) are not startup
    from stallfree.tokens import packing  # noqa: F401

    t0 = time.perf_counter()
    loader = stallfree.DataLoader(
        stallfree.TokenDataset(MmapSource(str(root / "mega")), SEQ),
        batch_size=BATCH,
        num_workers=WORKERS,
        shuffle=True,
        seed=0,
    )
    return _consume(iter(loader), batches, t0, lambda b: b["input_ids"])


def run_nanogpt(root: Path, batches: int) -> dict:
    import torch

    def get_batch():
        data = np.memmap(root / "raw.bin", dtype=np.int32, mode="r")  # nanoGPT recreates it per batch
        ix = torch.randint(len(data) - SEQ, (BATCH,))
        x = torch.stack([torch.from_numpy(data[i : i + SEQ].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + SEQ].astype(np.int64)) for i in ix])
        return x, y

    def gen():
        while True:
            yield get_batch()

    return _consume(gen(), batches, time.perf_counter(), lambda b: b[0])


def run_litdata(root: Path, batches: int, sub: str = "lit") -> dict:
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    t0 = time.perf_counter()
    ds = StreamingDataset(str(root / sub), item_loader=TokensLoader(block_size=SEQ + 1), shuffle=True, seed=0)
    loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)

    def gen():
        while True:
            yield from loader

    return _consume(gen(), batches, t0, lambda b: b[:, :SEQ])


def first_stallfree_many(root: Path) -> dict:
    import stallfree
    from stallfree.loader import dataloader  # noqa: F401 - imports (torch) are not startup
    from stallfree.tokens import packing  # noqa: F401

    t0 = time.perf_counter()
    loader = stallfree.DataLoader(
        stallfree.TokenDataset(str(root / "many"), SEQ),
        batch_size=BATCH,
        num_workers=WORKERS,
        shuffle=True,
        seed=0,
    )
    next(iter(loader))
    return {"first_batch_s": time.perf_counter() - t0}


def first_litdata_many(root: Path) -> dict:
    return run_litdata(root, 0, "lit_many")


def _consume(it, batches: int, t0: float, inputs) -> dict:
    first = next(it)
    t1 = time.perf_counter()
    shape = tuple(inputs(first).shape)
    for _ in range(batches):
        x = inputs(next(it))
        int(x[:, ::512].sum())  # the step reads every 4 KiB page of its inputs, as a device copy would
    t2 = time.perf_counter()
    if batches:
        assert tuple(x.shape) == shape == (BATCH, SEQ), shape
    return {"first_batch_s": t1 - t0, "tokens_per_s": batches * BATCH * SEQ / (t2 - t1) if batches else None}


RUNS = {
    "stallfree": run_stallfree,
    "nanogpt": run_nanogpt,
    "litdata": run_litdata,
    "stallfree-mmap": run_stallfree_mmap,
    "stallfree-1000-files": lambda root, _: first_stallfree_many(root),
    "litdata-1000-files": lambda root, _: first_litdata_many(root),
}


class MappedArrowSource:
    """Arrow IPC token files as views of memory maps (each record batch's ``input_ids`` values
    zero-copy): ``ArrowTokenSource``'s read path before it moved to ``pread``, kept here only to
    measure against. A window inside one batch is a view, across batches the views joined."""

    def __init__(self, folder: str) -> None:
        import pyarrow as pa
        import pyarrow.ipc as ipc

        pieces, lengths = [], []
        for path in sorted(Path(folder).glob("*.arrow")):
            reader = ipc.open_file(pa.memory_map(str(path), "r"))
            for b in range(reader.num_record_batches):
                col = reader.get_batch(b).column("input_ids")
                pieces.append(col.values.to_numpy(zero_copy_only=True))
                lengths.append(np.diff(np.asarray(col.offsets)))
        self.name, self.dtype = Path(folder).name, pieces[0].dtype
        self.doc_lengths = np.concatenate(lengths).astype(np.int64)
        self.fingerprint = f"mapped-arrow-{folder}"
        self._pieces = pieces
        self._starts = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)

    def read(self, start: int, stop: int) -> np.ndarray:
        starts = self._starts
        p = int(np.searchsorted(starts, start, "right")) - 1
        if stop <= starts[p + 1]:
            return self._pieces[p][start - starts[p] : stop - starts[p]]
        parts = []
        while start < stop:
            hi = min(stop, starts[p + 1])
            parts.append(self._pieces[p][start - starts[p] : hi - starts[p]])
            start, p = hi, p + 1
        return np.concatenate(parts)


def read_path_in_process(root: Path, batches: int, rounds: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per corpus and read path: best Mtok/s of ``get_batch`` in this process and best CPU µs per
    batch (user + system of this process: what a loaded machine disturbs least). Each round draws
    new random windows per corpus (so a map's first-touch faults are in it, as in a fresh worker)
    and gives the same ones to both read paths, the order reversed every other round."""
    from stallfree.tokens.arrow_tokens import ArrowTokenSource
    from stallfree.tokens.megatron import MegatronSource
    from stallfree.tokens.packing import TokenDataset

    prefix = str(root / "mega")
    groups = {}
    for eos in (None, 50256):
        groups[f"Megatron .bin, eos={eos}"] = {
            "pread": TokenDataset(MegatronSource(prefix), SEQ, eos=eos),
            "mmap": TokenDataset(MmapSource(prefix), SEQ, eos=eos),
        }
    files = len(list((root / "many").glob("*.arrow")))
    groups[f"Arrow IPC, {files} files"] = {
        "pread": TokenDataset(ArrowTokenSource(str(root / "many")), SEQ),
        "mmap": TokenDataset(MappedArrowSource(str(root / "many")), SEQ),
    }
    best = {g: dict.fromkeys(pair, 0.0) for g, pair in groups.items()}
    cpu = {g: dict.fromkeys(pair, float("inf")) for g, pair in groups.items()}
    rng = np.random.default_rng(0)
    for r in range(rounds):
        for group, pair in groups.items():
            windows = rng.integers(0, len(pair["pread"]), (batches, BATCH))
            for name in list(pair) if r % 2 == 0 else list(pair)[::-1]:
                ds = pair[name]
                t0, c0 = time.perf_counter(), time.process_time()
                for idx in windows:
                    x = ds.get_batch(idx)["input_ids"]
                    int(x[:, ::512].sum())  # as the training loop of the loader runs
                c1, t1 = time.process_time(), time.perf_counter()
                best[group][name] = max(best[group][name], batches * BATCH * SEQ / (t1 - t0) / 1e6)
                cpu[group][name] = min(cpu[group][name], (c1 - c0) / batches * 1e6)
    return {g: {n: (best[g][n], cpu[g][n]) for n in pair} for g, pair in groups.items()}


def read_path(root: Path, batches: int, rounds: int) -> int:
    inproc = read_path_in_process(root, batches, rounds)
    loaders: dict[str, list[dict]] = {"stallfree": [], "stallfree-mmap": []}
    for r in range(rounds):
        for name in list(loaders) if r % 2 == 0 else list(loaders)[::-1]:
            loaders[name].append(_child(name, root, batches))
    print(f"seq_len {SEQ}, batch {BATCH}, int32 tokens, best of {rounds} rounds, cpus {os.cpu_count()}")
    print(
        f"{'get_batch in one process':<44}{'Mtok/s':>8}{'pread/mmap':>12}{'CPU us/batch':>14}{'pread/mmap':>12}"
    )
    for group, pair in inproc.items():
        (p, pc), (m, mc) = pair["pread"], pair["mmap"]
        print(f"{group + ': pread':<44}{p:>8.1f}{p / m:>12.2f}{pc:>14.0f}{pc / mc:>12.2f}")
        print(f"{group + ': mmap':<44}{m:>8.1f}{1.0:>12.2f}{mc:>14.0f}{1.0:>12.2f}")
    tps = {}
    for name, runs in loaders.items():
        got = [x["tokens_per_s"] for x in runs if x.get("tokens_per_s")]
        tps[name] = max(got) / 1e6 if got else None
        errors = [x["error"] for x in runs if "error" in x]
        if errors:
            print(f"{name}: errors {errors}")
    p, m = tps["stallfree"], tps["stallfree-mmap"]
    if p and m:
        print(f"{f'DataLoader, {WORKERS} workers, Megatron .bin: pread':<44}{p:>8.1f}{p / m:>12.2f}")
        print(f"{f'DataLoader, {WORKERS} workers, Megatron .bin: mmap':<44}{m:>8.1f}{1.0:>12.2f}")
        rounds_ratio = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(loaders["stallfree"], loaders["stallfree-mmap"], strict=True)
            if a.get("tokens_per_s") and b.get("tokens_per_s")
        ]
        print("DataLoader pread / mmap per round: " + ", ".join(f"{x:.2f}" for x in rounds_ratio))
    return 0


def _child(name: str, root: Path, batches: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, "--dir", str(root), "--batches", str(batches)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64_000_000)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where the corpus lives (kept; default a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--read-path", action="store_true", help="pread vs memory map (module docstring)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(RUNS[args.child](Path(args.dir), args.batches)))
        return 0
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-tokens-"))
    root.mkdir(parents=True, exist_ok=True)
    build(root, args.tokens, args.files)
    for p in root.rglob("*"):  # warm the page cache
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
    if args.read_path:
        return read_path(root, args.batches, args.rounds)
    names = ["stallfree", "nanogpt"] + (["litdata"] if _has_litdata() else [])
    firsts = ["stallfree-1000-files"] + (["litdata-1000-files"] if _has_litdata() else [])
    results: dict[str, list[dict]] = {n: [] for n in names + firsts}
    for r in range(args.rounds):
        order = names + firsts if r % 2 == 0 else (names + firsts)[::-1]
        for name in order:
            results[name].append(_child(name, root, args.batches))
    summary = {}
    for name, runs in results.items():
        ok = [x for x in runs if "error" not in x]
        tps = [x["tokens_per_s"] for x in ok if x.get("tokens_per_s")]
        summary[name] = {
            "tokens_per_s": max(tps) if tps else None,
            "first_batch_s": min(x["first_batch_s"] for x in ok) if ok else None,
            "errors": [x["error"] for x in runs if "error" in x],
        }
    base = summary["stallfree"]["tokens_per_s"]
    for s in summary.values():
        s["stallfree_ratio"] = base / s["tokens_per_s"] if base and s["tokens_per_s"] else None
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(
        f"seq_len {SEQ}, batch {BATCH}, int32 tokens, {WORKERS} workers, best of {args.rounds} rounds, cpus {os.cpu_count()}"
    )
    print(f"{'contender':<22}{'Mtok/s':>10}{'stallfree x':>13}{'first batch s':>15}")
    for name, s in summary.items():
        tps = f"{s['tokens_per_s'] / 1e6:.1f}" if s["tokens_per_s"] else "-"
        ratio = f"{s['stallfree_ratio']:.2f}" if s["stallfree_ratio"] else "-"
        first = f"{s['first_batch_s']:.2f}" if s["first_batch_s"] is not None else "-"
        print(
            f"{name:<22}{tps:>10}{ratio:>13}{first:>15}" + (f"  errors: {s['errors']}" if s["errors"] else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

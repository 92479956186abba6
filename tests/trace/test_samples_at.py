"""``loader.samples_at(step, rank)`` and ``stallfree trace`` name exactly what the loader delivered:
1-4 ranks, 0-2 workers, shuffled image shards, packed token windows and a scheduled mixture,
computed from the order and the saved state, never from a log."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import stallfree
from stallfree.cli import main
from stallfree.loader.dataloader import DataLoader
from stallfree.loader.epoch.samples import trace_state
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import random_docs, write_megatron
from tests.trace.helpers import keys_of, mixture_keys, three_stage_mixture, write_images


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1), (4, 0)])
def test_image_keys_of_every_step_on_every_rank(tmp_path, world, workers):
    ds = stallfree.open_dataset(write_images(tmp_path / "img"))
    delivered = {}
    loaders = []
    for rank in range(world):
        dl = DataLoader(
            ds,
            batch_size=4,
            shuffle=True,
            seed=11,
            world=(rank, world),
            num_workers=workers,
            collate_fn=keys_of,
        )
        loaders.append(dl)
        for epoch in range(2):
            for b, keys in enumerate(dl):
                delivered[(rank, epoch * len(dl) + b)] = keys
    for (rank, step), keys in delivered.items():
        found = loaders[0].samples_at(step, rank)
        assert found.keys == keys  # exact, in batch order
        assert [s.shard for s in found.samples] == [
            ds.manifest.shards[ds.locate(i)[0]].path for i in found.indices
        ]
    state = loaders[0].state_dict()
    for (rank, step), keys in itertools.islice(delivered.items(), 0, None, 3):
        assert trace_state(state, ds, step, rank).keys == keys  # from the saved state alone


def test_packed_token_windows_name_their_documents_and_offsets(tmp_path):
    docs = random_docs(3, n=30, max_len=25)
    write_megatron(tmp_path / "c", docs, "int32")
    ds = TokenDataset(str(tmp_path / "c"), 8)
    dl = DataLoader(ds, batch_size=3, shuffle=True, seed=2, world=(1, 2), num_workers=1)
    for step, batch in enumerate(dl):
        found = dl.samples_at(step)
        assert len(found.samples) == len(batch["input_ids"])
        for sample, ids, doc_ids in zip(found.samples, batch["input_ids"], batch["doc_ids"], strict=True):
            spans = sample.documents
            # the named token ranges of the named documents are exactly the window's inputs
            assert [t for d in spans for t in docs[d.doc][d.offset : d.offset + d.tokens]] == ids.tolist()
            assert [d.doc for d in spans for _ in range(d.tokens)] == doc_ids.tolist()
            assert sample.token_source == ds.source.name


def test_a_scheduled_mixture_names_source_and_index_across_stage_boundaries(tmp_path):
    got = {}
    for rank in range(3):
        dl = DataLoader(
            three_stage_mixture(), batch_size=5, world=(rank, 3), num_workers=2 if rank == 1 else 0
        )
        for epoch in range(3):  # the stages at 53 and 171 fall in epochs 0 and 1
            for b, batch in enumerate(dl):
                got[(rank, epoch * len(dl) + b)] = mixture_keys(batch)
    state = dl.state_dict()
    for (rank, step), keys in got.items():
        found = trace_state(state, three_stage_mixture(), step, rank)
        assert [(s.source, s.source_index) for s in found.samples] == keys


def test_samples_at_after_a_resume_on_another_world_size(tmp_path):
    ds = stallfree.open_dataset(write_images(tmp_path / "img"))
    first = DataLoader(ds, batch_size=3, shuffle=True, seed=4, world=(0, 3), collate_fn=keys_of)
    it = iter(first)
    for _ in range(2):
        next(it)
    state = first.state_dict()
    assert state["step"] == 2
    resumed = {}
    for rank in range(2):
        dl = DataLoader(ds, batch_size=3, shuffle=True, seed=4, world=(rank, 2), collate_fn=keys_of)
        dl.load_state_dict(state)
        for b, keys in enumerate(dl):
            resumed[(rank, 2 + b)] = keys
        later = dl.state_dict()
    assert [h["world_size"] for h in later["history"]] == [3, 2]
    for (rank, step), keys in resumed.items():
        assert trace_state(later, ds, step, rank).keys == keys
    assert trace_state(later, ds, 1, 2).keys == first.samples_at(1, 2).keys  # before the resume: 3 ranks
    with pytest.raises(ValueError, match="outside the world of 2"):
        trace_state(later, ds, 3, 2)


def test_stallfree_trace_prints_the_batch(tmp_path, capsys):
    root = write_images(tmp_path / "img")
    ds = stallfree.open_dataset(root)
    dl = DataLoader(ds, batch_size=4, shuffle=True, seed=9, world=(1, 2), collate_fn=keys_of)
    batches = list(itertools.islice(dl, 3))
    path = tmp_path / "state.json"
    path.write_text(json.dumps(dl.state_dict()))
    assert main(["trace", str(path), "--step", "2", "--rank", "1", "--data", root, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["key"] for s in out["samples"]] == batches[2]
    assert main(["trace", str(path), "--step", "2", "--rank", "1", "--data", root]) == 0
    text = capsys.readouterr().out
    assert all(k in text for k in batches[2]) and "world size 2" in text
    assert main(["trace", str(path), "--step", "2", "--rank", "5", "--data", root]) == 1
    assert "outside the world of 2" in capsys.readouterr().err
    assert json.loads(path.read_text())["url"] == root  # the state names where the data was opened
    assert main(["trace", str(path), "--step", "2", "--rank", "1", "--json"]) == 0
    assert [s["key"] for s in json.loads(capsys.readouterr().out)["samples"]] == batches[2]
    state = json.loads(path.read_text())
    del state["url"]
    path.write_text(json.dumps(state))
    assert main(["trace", str(path), "--step", "2"]) == 1
    assert "pass --data URL or --dataset" in capsys.readouterr().err


def test_trace_refuses_a_state_of_other_data(tmp_path):
    ds = stallfree.open_dataset(write_images(tmp_path / "img"))
    other = stallfree.open_dataset(write_images(tmp_path / "other", n=38))
    dl = DataLoader(ds, batch_size=4, shuffle=True, seed=9)
    next(iter(dl))
    with pytest.raises(ValueError, match="38"):
        trace_state(dl.state_dict(), other, 0)
    assert np.array_equal(dl.samples_at(0).indices, trace_state(dl.state_dict(), ds, 0).indices)

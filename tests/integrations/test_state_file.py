"""The loaders' states in a checkpoint: JSON, written whole or not at all, read with a size bound,
and every fault a typed error naming the file."""

from __future__ import annotations

import json
import pickle

import pytest

from stallfree.integrations import state_file
from stallfree.integrations.state_file import LoaderStateFileError, MissingLoaderStateError

STATE = {
    "format": "stallfree.loader.epoch.state",
    "version": 1,
    "mode": "fast",
    "seed": 3,
    "epoch": 1,
    "consumed": 24,
    "dataset_len": 48,
    "batches": 0,
    "world_size": 2,
    "order": "global/r1",
}


def test_round_trip_is_plain_json_beside_the_checkpoint(tmp_path):
    path = state_file.write(tmp_path / "checkpoint-9", [STATE], step=9, world_size=2)
    assert path == tmp_path / "checkpoint-9" / "stallfree_loader_state.json"
    on_disk = json.loads(path.read_text())
    assert on_disk["loaders"] == [STATE] and on_disk["step"] == 9
    saved = state_file.read(tmp_path / "checkpoint-9")
    assert saved == state_file.SavedLoaders((STATE,), 9, 2)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind


def test_a_failed_write_keeps_the_file_that_was_there(tmp_path):
    state_file.write(tmp_path, [STATE], step=3, world_size=2)
    with pytest.raises(TypeError):
        state_file.write(tmp_path, [{"seed": object()}], step=6, world_size=2)
    assert state_file.read(tmp_path).step == 3
    assert len(list(tmp_path.iterdir())) == 1


def test_a_checkpoint_without_the_file_says_so_and_names_it(tmp_path):
    with pytest.raises(MissingLoaderStateError, match="saved without stallfree.integrations") as info:
        state_file.read(tmp_path)
    assert info.value.path == str(tmp_path / "stallfree_loader_state.json")
    again = pickle.loads(pickle.dumps(info.value))
    assert (type(again), again.path, str(again)) == (
        MissingLoaderStateError,
        info.value.path,
        str(info.value),
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # nesting past the decoder's depth
        (json.dumps({"format": "other"}).encode(), "not a stallfree.integrations.loader_states file"),
        (json.dumps({"format": state_file.FORMAT, "version": 9}).encode(), "unsupported version 9"),
        (
            json.dumps({"format": state_file.FORMAT, "version": 1, "loaders": [1]}).encode(),
            "list of loader states",
        ),
        (json.dumps({"format": state_file.FORMAT, "version": 1, "loaders": []}).encode(), "malformed"),
    ],
)
def test_a_malformed_file_is_an_error_naming_it(tmp_path, content, message):
    (tmp_path / state_file.STATE_FILE).write_bytes(content)
    with pytest.raises(LoaderStateFileError, match=message) as info:
        state_file.read(tmp_path)
    assert info.value.path == str(tmp_path / state_file.STATE_FILE)


def test_a_huge_file_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    monkeypatch.setattr(state_file, "MAX_BYTES", 64)
    (tmp_path / state_file.STATE_FILE).write_bytes(b" " * 65)
    with pytest.raises(LoaderStateFileError, match="larger than 64 bytes"):
        state_file.read(tmp_path)

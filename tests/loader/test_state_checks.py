"""``load_state_dict`` refuses what it cannot continue from exactly, with a clear error.

Before: a negative or too-large position was accepted (the next epoch silently had 0 samples),
a state from another dataset of the same length loaded silently, and a deeply nested state
raised ``RecursionError`` in whatever walked it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stallfree import DataLoader, mix
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.errors import StateMismatchError
from tests.loader.helpers import Numbers, Sharded, indices

ROOT = Path(__file__).resolve().parents[2]


def _fast(ds=None, **kw) -> DataLoader:
    return DataLoader(ds if ds is not None else Numbers(40), batch_size=4, shuffle=True, seed=5, **kw)


def _sampler(ds=None) -> DataLoader:
    return DataLoader(ds if ds is not None else Numbers(40), batch_size=4)


def _saved(dl: DataLoader, batches: int = 2) -> dict:
    it = iter(dl)
    for _ in range(batches):
        next(it)
    return json.loads(json.dumps(dl.state_dict()))


@pytest.mark.parametrize("consumed", [-1, 41, 10**12])
def test_a_position_outside_the_epoch_is_refused_naming_value_and_range(consumed):
    st = {**_saved(_fast()), "consumed": consumed}
    with pytest.raises(StateMismatchError, match=rf"'consumed' is {consumed}, outside this epoch's 0\.\.40"):
        _fast().load_state_dict(st)


@pytest.mark.parametrize("batches", [-3, 11])
def test_a_batch_count_outside_the_epoch_is_refused(batches):
    st = {**_saved(_sampler()), "batches": batches}
    with pytest.raises(
        StateMismatchError, match=rf"'batches' is {batches}, outside this epoch's 0\.\.10 batches"
    ):
        _sampler().load_state_dict(st)


def test_a_negative_epoch_and_non_integers_are_refused():
    st = _saved(_fast())
    with pytest.raises(ValueError, match="'epoch' is -1, must be >= 0"):
        _fast().load_state_dict({**st, "epoch": -1})
    with pytest.raises(ValueError, match="'consumed' is True"):
        _fast().load_state_dict({**st, "consumed": True})
    with pytest.raises(ValueError, match=r"'consumed' is 8\.5 \(float\), not an integer"):
        _fast().load_state_dict({**st, "consumed": 8.5})


def test_the_ends_of_the_range_still_load():
    st = _saved(_fast())
    full = indices(_fast())
    for consumed, rest in ((0, full), (40, [])):
        dl = _fast()
        dl.load_state_dict({**st, "consumed": consumed})
        assert indices(dl) == rest


class OtherContent(Sharded):
    """The same shape as ``Sharded`` (16 samples, two shards), other content."""

    fingerprint = "e" * 16


def test_a_state_of_another_dataset_is_refused_by_fingerprint():
    st = _saved(_fast(Sharded()))
    assert st["fingerprint"] == "f" * 16 and st["dataset_len"] == 16
    with pytest.raises(
        StateMismatchError, match=r"fingerprint 'ffffffffffffffff', this one's is 'eeeeeeeeeeeeeeee'"
    ):
        _fast(OtherContent()).load_state_dict(st)


def test_allow_other_dataset_continues_from_the_saved_position_on_purpose():
    st = _saved(_fast(Sharded()))  # 8 positions consumed
    dl = _fast(OtherContent())
    dl.load_state_dict(st, allow_other_dataset=True)
    assert indices(dl) == indices(_fast(OtherContent()))[8:]
    longer = _fast(Numbers(50))
    longer.load_state_dict(st, allow_other_dataset=True)  # another length too, on purpose
    assert indices(longer) == indices(_fast(Numbers(50)))[8:]
    with pytest.raises(StateMismatchError, match="'consumed' is 8, outside this epoch's 0..4"):
        _fast(Numbers(4)).load_state_dict(st, allow_other_dataset=True)  # the position must still fit


def test_a_sampler_state_of_another_length_is_refused():
    st = _saved(_sampler())
    assert st["dataset_len"] == 40
    with pytest.raises(
        StateMismatchError, match="dataset of 40 samples, this one has 44.*allow_other_dataset"
    ):
        _sampler(Numbers(44)).load_state_dict(st)


def test_states_saved_before_the_identity_was_recorded_still_load():
    fast = _saved(_fast(Sharded()))
    del fast["fingerprint"]
    dl = _fast(OtherContent())
    dl.load_state_dict(fast)  # no fingerprint: the length alone is checked
    assert indices(dl) == indices(_fast(OtherContent()))[8:]
    sampler = {**_saved(_sampler()), "dataset_len": 0}  # what the sampler mode saved before
    dl = _sampler(Numbers(44))
    dl.load_state_dict(sampler)
    assert indices(dl) == list(range(8, 44))


def _deep(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def _mixture() -> DataLoader:
    return DataLoader(mix({"a": Numbers(30), "b": Numbers(10)}, {"a": 0.5, "b": 0.5}, seed=1), batch_size=4)


@pytest.mark.parametrize("levels", [40, 200_000])
@pytest.mark.parametrize("make", [_fast, _mixture])
def test_a_deeply_nested_state_is_a_value_error_not_a_recursion_error(make, levels):
    """A mixture compares the saved description with its own: a state nested 200,000 levels deep
    was a RecursionError there; now ``from_dict`` refuses it before anything walks it."""
    saved = _saved(make())
    described = {**(saved.get("dataset") or {}), "fingerprint": "other", "weights": _deep(levels)}
    st = {**saved, "dataset": described}
    with pytest.raises(
        ValueError, match="nested deeper than 32 levels at state\\['dataset'\\]\\['weights'\\]"
    ):
        make().load_state_dict(st)
    with pytest.raises(ValueError, match="nested deeper"):
        LoaderState.from_dict(st)


def test_a_state_with_too_many_values_is_refused():
    st = {**_saved(_fast()), "dataset": {"x": list(range(200_000))}}
    with pytest.raises(ValueError, match="more than 100000 values"):
        LoaderState.from_dict(st)


def test_keeping_batches_past_the_descriptor_limit_says_what_to_do():
    """Every kept batch holds one shared-memory descriptor: at a low ``ulimit -n`` the error
    names the cause and the fixes (before: torch's "could not duplicate a shared memory file
    descriptor")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip("hard descriptor limit below 256")
    script = """
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from stallfree import DataLoader, mix
    from tests.loader.helpers import Numbers
    dl = DataLoader(Numbers(2400), batch_size=4, shuffle=True, num_workers=2)
    kept = []
    try:
        for batch in dl:
            kept.append(batch)
    except Exception as exc:
        print("ERROR", type(exc).__name__, exc, flush=True)
    print("KEPT", len(kept), flush=True)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR"))
    assert error.startswith("ERROR TooManyOpenFilesError too many open files (ulimit -n is 256"), error
    assert "every batch kept alive holds one shared-memory file descriptor" in error
    assert "`ulimit -n" in error and "RLIMIT_NOFILE" in error and "tensor.clone()" in error


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("world_size", 0, "'world_size' is 0, must be >= 1"),
        ("world_size", -4, "'world_size' is -4, must be >= 1"),
        ("dataset_len", -1, "'dataset_len' is -1, must be >= 0"),
        ("version", True, "unsupported loader state version True"),
    ],
)
def test_a_world_of_no_ranks_a_negative_length_and_a_bool_version_are_malformed(field, value, message):
    """These loaded silently (the world size is only informational, ``True == 1``): a state
    that says them is damaged, and saying so beats resuming from it."""
    st = _saved(_fast())
    with pytest.raises(ValueError, match=message):
        _fast().load_state_dict({**st, field: value})
    _fast().load_state_dict(st)  # the undamaged state still loads

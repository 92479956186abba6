"""Failed samples are named by their key, never by an index dressed up as one; batch steps are
named as batch steps; ``max_failures`` floats are fractions (issue 18, items 8 and 9).

Before: ``stats()['failed_keys']`` and the "(key ...)" of a fetch error held the index (``'474'``
for sample ``'000474'``), a collate_fn error read "while loading sample 0", and
``max_failures=1.0`` allowed one failure, not all of them.
"""

from __future__ import annotations

import pytest

import stallfree
from stallfree import DataLoader
from stallfree.errors import SampleDecodeError
from stallfree.loader import contracts
from stallfree.loader.assembler import failure_budget
from stallfree.loader.errors import FailureBudgetExceeded
from tests.loader.helpers import Failing, Numbers


class KeyedFailing(Numbers):
    """Tells each sample's key without reading it (``key_of``); reads of ``bad`` raise."""

    def __init__(self, n: int, bad: set[int]) -> None:
        super().__init__(n)
        self.bad = set(bad)

    def key_of(self, index: int) -> str:
        return f"{index:06d}"

    def __getitem__(self, i: int) -> dict:
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return {"__key__": self.key_of(i), **super().__getitem__(i)}


class ReaderNamesKey(Numbers):
    """No ``key_of``, but the read's own error names the member it was parsing (a ShardError)."""

    def __getitem__(self, i: int) -> dict:
        if i == 5:
            raise SampleDecodeError("truncated member", shard="s-0.tar", key="s000005", offset=512)
        return super().__getitem__(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_failed_keys_are_the_samples_keys(num_workers):
    dl = DataLoader(KeyedFailing(40, {7, 33}), batch_size=4, num_workers=num_workers, on_error="skip")
    assert sorted(i for b in dl for i in b["i"].tolist()) == sorted(set(range(40)) - {7, 33})
    assert sorted(dl.stats()["failed_keys"]) == ["000007", "000033"]


def test_the_key_a_read_error_names_is_the_failed_key():
    dl = DataLoader(ReaderNamesKey(12), batch_size=4, num_workers=1, on_error="skip")
    assert len([b for b in dl]) == 3
    assert dl.stats()["failed_keys"] == ["s000005"]


def test_an_unknown_key_is_reported_as_an_index():
    dl = DataLoader(Failing(12, {5}), batch_size=4, num_workers=1, on_error="skip")
    list(dl)
    assert dl.stats()["failed_keys"] == ["index 5"]


def test_a_fetch_error_names_the_sample_by_key_and_index():
    dl = DataLoader(KeyedFailing(20, {13}), batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match="bad sample 13") as err:
        list(dl)
    assert "while loading sample '000013' (index 13)" in str(err.value)


def test_a_fetch_error_without_a_key_says_index_not_key():
    dl = DataLoader(Failing(20, {13}), batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match="bad sample 13") as err:
        list(dl)
    msg = str(err.value)
    assert "while loading sample at index 13" in msg and "key" not in msg.split("Original")[0]


def _bad_collate(samples: list) -> dict:
    raise RuntimeError("collate_fn bug")


def test_a_collate_fn_error_is_a_batch_step_not_a_sample_load():
    dl = DataLoader(Numbers(16), batch_size=4, num_workers=1, collate_fn=_bad_collate)
    with pytest.raises(RuntimeError, match="collate_fn bug") as err:
        next(iter(dl))
    msg = str(err.value)
    assert "while collating batch 0 (4 samples, first index 0)" in msg
    assert "while loading" not in msg


def test_a_sharded_dataset_speaks_the_keyed_protocol(tmp_path):
    with stallfree.ShardWriter(str(tmp_path / "ds"), format="tar", max_samples=4) as w:
        for i in range(6):
            w.write({"__key__": f"{i:06d}", "txt": b"x"})
    ds = stallfree.open_dataset(str(tmp_path / "ds"))
    assert isinstance(ds, contracts.KeyedSource)
    assert contracts.failed_key(ds, 4, ValueError("read failed")) == "000004"


# -- max_failures: an int is a count, a float in [0, 1] a fraction ---------------------------------
@pytest.mark.parametrize(
    "max_failures, samples, allowed",
    [(1.0, 30, 30), (1, 30, 1), (0.5, 30, 15), (0.0, 30, 0), (0, 30, 0), (None, 30, None)],
)
def test_failure_budget(max_failures, samples, allowed):
    assert failure_budget(max_failures, samples) == allowed


@pytest.mark.parametrize(
    "bad, error", [(2.0, ValueError), (-1, ValueError), (True, TypeError), ("3", TypeError)]
)
def test_max_failures_rejects_what_it_cannot_mean(bad, error):
    with pytest.raises(error, match="max_failures"):
        DataLoader(Numbers(4), max_failures=bad)


def test_max_failures_1_0_lets_every_sample_fail_and_1_lets_one():
    every = set(range(12))
    dl = DataLoader(Failing(12, every), batch_size=4, shuffle=True, seed=0, on_error="skip", max_failures=1.0)
    assert list(dl) == [] and dl.stats()["failures"] == 12
    dl = DataLoader(Failing(12, every), batch_size=4, shuffle=True, seed=0, on_error="skip", max_failures=1)
    with pytest.raises(FailureBudgetExceeded, match=r"allows \(1\)"):
        list(dl)

"""A new epoch order is one definition and one ``register_order`` line (issue 23): the toy order
below is registered here, then chosen by name through ``DataLoader(order=...)``; options refuse
a name nobody registered, naming the ones that are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from stallfree import DataLoader
from stallfree.loader.epoch import order as order_mod
from stallfree.loader.epoch.world import World
from stallfree.loader.options import LoaderOptions
from tests.loader.helpers import Numbers


@dataclass(frozen=True)
class Reversed:
    """Position p holds sample n-1-p (the same every epoch: a pure function of the request)."""

    n: int

    def at(self, positions):
        return (self.n - 1) - np.asarray(positions, np.int64)


@pytest.fixture
def reversed_order():
    order_mod.register_order("reversed", lambda req: Reversed(req.n))  # the one registration line
    yield "reversed"
    order_mod.unregister_order("reversed")


def _indices(loader) -> list[list[int]]:
    return [batch["i"].tolist() for batch in loader]


def test_a_registered_order_is_used_by_name(reversed_order):
    loader = DataLoader(Numbers(10), batch_size=4, order=reversed_order, seed=0)
    assert loader.mode == "fast"
    assert _indices(loader) == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]


def test_a_registered_order_reaches_worker_processes(reversed_order):
    loader = DataLoader(Numbers(10), batch_size=4, order=reversed_order, seed=0, num_workers=2)
    try:
        assert _indices(loader) == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]
    finally:
        loader.close()


def test_ranks_split_a_registered_order_and_resume_it(reversed_order):
    """Rank r of 2 takes positions r, r+2, ...: disjoint shares that cover the epoch; a saved
    state resumes on one rank with exactly the rest."""
    shares = [
        _indices(DataLoader(Numbers(8), batch_size=2, order=reversed_order, seed=0, world=World(r, 2)))
        for r in range(2)
    ]
    assert shares == [[[7, 5], [3, 1]], [[6, 4], [2, 0]]]
    first = DataLoader(Numbers(8), batch_size=2, order=reversed_order, seed=0)
    it = iter(first)
    got = [next(it)["i"].tolist()]
    again = DataLoader(Numbers(8), batch_size=2, order=reversed_order, seed=0)
    again.load_state_dict(first.state_dict())
    assert got + _indices(again) == [[7, 6], [5, 4], [3, 2], [1, 0]]


def test_options_accept_only_registered_orders(reversed_order):
    assert LoaderOptions(order=reversed_order).order == "reversed"
    order_mod.unregister_order(reversed_order)
    with pytest.raises(
        ValueError, match=r"order must be 'auto' or one of \('global', 'block', 'sequential'\)"
    ):
        LoaderOptions(order=reversed_order)


def test_a_name_is_registered_once_unless_replaced(reversed_order):
    with pytest.raises(ValueError, match="order 'reversed' is already registered"):
        order_mod.register_order(reversed_order, lambda req: Reversed(req.n))
    with pytest.raises(ValueError, match="other than 'auto'"):
        order_mod.register_order("auto", lambda req: Reversed(req.n))


def test_an_order_of_the_wrong_length_is_refused():
    order_mod.register_order("short", lambda req: Reversed(req.n - 1))
    try:
        with pytest.raises(ValueError, match="order 'short' covers 9 positions, the dataset has 10 samples"):
            order_mod.make_order(0, 0, 10, mode="short")
    finally:
        order_mod.unregister_order("short")

"""in_order=False: free workers take new work while one is slow, and a state saved while an early
batch is still outstanding never skips it (only the unbroken run of received batches counts)."""

from __future__ import annotations

import itertools
import time

import torch.utils.data as tud

from stallfree.loader.dataloader import DataLoader


class SlowFirst(tud.Dataset):
    """Sample i is i; sample 0 takes ``seconds``."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == 0:
            time.sleep(self.seconds)
        return i


def test_a_state_saved_while_the_first_batch_is_outstanding_resumes_from_it():
    dl = DataLoader(SlowFirst(24, 3.0), batch_size=2, seed=0, num_workers=2, in_order=False)
    assert dl.fast_path
    it = iter(dl)
    early = [b.tolist() for b in itertools.islice(it, 3)]
    assert [0, 1] not in early  # later batches overtook the slow first one
    state = dl.state_dict()
    assert state["consumed"] == 0  # batch 0 not received: nothing counts yet
    rest = [i for b in it for i in b.tolist()]
    assert sorted([i for b in early for i in b] + rest) == list(range(24))
    assert dl.state_dict()["epoch"] == 1  # all received: the next save starts the next epoch

    again = DataLoader(SlowFirst(24, 0.0), batch_size=2, seed=0, num_workers=2, in_order=False)
    again.load_state_dict(state)
    resumed = sorted(i for b in again for i in b.tolist())
    assert resumed == list(range(24))  # nothing lost; the overtaking batches come again

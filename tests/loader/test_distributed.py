"""Two real processes with a gloo process group: the loader reads rank/world from torch.distributed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from stallfree.loader.dataloader import DataLoader
from tests.loader.helpers import Numbers
from tests.zygote import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # workers fork, as they do under torchrun (a rank started by torch's spawn would default to
        # spawn, and every spawned worker would import torch again: seconds each, nothing tested)
        dl = DataLoader(  # no seed: ranks agree on 0
            Numbers(41), batch_size=4, shuffle=True, num_workers=1, multiprocessing_context="fork"
        )
        assert dl.world.rank == rank and dl.world.size == world
        mine = [i for b in dl for i in b["i"].tolist()]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"indices": mine, "batches": dl.stats()["batches"]})
        if rank == 0:
            import json

            with open(f"{out_dir}/result.json", "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


_RANK = """
import sys
from tests.loader.test_distributed import _run
_run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
"""
RANK_TIMEOUT = 300  # a bound on a hang, not a speed requirement


@pytest.mark.slow
def test_two_gloo_ranks_get_disjoint_equal_shares(tmp_path):
    # two rank processes forked from the test zygote (torch imported once, not once per rank: what
    # is tested is the ranks' process group and shares, not an interpreter's start)
    run_ranks(_RANK, 2, str(tmp_path / "init"), str(tmp_path), timeout=RANK_TIMEOUT, cwd=ROOT)
    import json

    r0, r1 = json.loads((tmp_path / "result.json").read_text())
    assert r0["batches"] == r1["batches"] == 6
    assert len(r0["indices"]) == len(r1["indices"]) == 21
    assert set(r0["indices"]) | set(r1["indices"]) == set(range(41))
    overlap = set(r0["indices"]) & set(r1["indices"])
    assert len(overlap) == 1  # pad: 41 is odd, one sample is repeated so both ranks get 21

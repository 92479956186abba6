"""The harness on CUDA: nccl-free single rank, model step on the GPU, DALI's mixed decode."""

from __future__ import annotations

import pytest
import torch

from stallfree.harness.loaders import loader_available
from stallfree.harness.runner import BenchConfig, run_bench
from tests.harness._helpers import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA (no GPU visible to torch); run benchmarks/gpu_check.sh on a GPU machine",
    ),
]


def test_model_step_on_gpu_with_every_installed_loader(tmp_path):
    from stallfree.harness.fixtures import write_jpeg_shards

    root = write_jpeg_shards(tmp_path / "shards", 64, per_shard=16, size=(64, 48))
    loaders = [n for n in ("stallfree", "torch", "dali") if loader_available(n) is None]
    report = run_bench(
        tiny_config(str(root), loaders, step="model", batch_size=8, image_size=32, device="cuda")
    )
    assert report["environment"]["gpu"]["count"] >= 1
    assert set(report["loaders"]) == set(loaders)
    for entry in report["loaders"].values():
        assert entry["job"]["samples"] == 24


def test_more_ranks_than_gpus_is_refused():
    cfg = BenchConfig(
        dataset="synthetic:8", loaders=["torch"], nproc=torch.cuda.device_count() + 1, device="cuda"
    )
    with pytest.raises(ValueError, match="need as many GPUs"):
        run_bench(cfg)

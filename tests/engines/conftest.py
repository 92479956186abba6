"""A real Ray cluster on loopback (``stallfree/testing/ray_cluster.py``), one per test module that
asks for it: a head with no CPUs and two worker nodes of one CPU each, carrying the custom
resource ``stallfree_cpu``, all on 127.0.0.1. Skipped with the reason when Ray is not installed."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'stallfree[ray]')")
    from stallfree.testing.ray_cluster import start_loopback_cluster

    cluster = start_loopback_cluster(worker_nodes=2, cpus_per_node=1, resource="stallfree_cpu")
    try:
        yield cluster
    finally:
        cluster.shutdown()

"""The loader: ``DataLoader`` (dataloader.py) over a seeded, world-size-independent epoch order
(order.py, world.py), worker processes with read-ahead and shared-memory slots (workers.py,
engine.py, shm.py, pipeline.py), the consumer-side iterator (prefetch.py), resume state (state.py),
stats (stats.py) and prefetch autotuning (autotune.py). Import from the submodules; ``stallfree``
re-exports ``DataLoader`` and ``get_worker_info``.
"""

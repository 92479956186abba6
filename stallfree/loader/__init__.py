"""The loader: ``DataLoader`` and what it runs, sorted by the side of the process boundary.

- root: the main process. ``dataloader.py`` (the public class), ``options.py`` / ``plan.py`` (frozen
  plans), ``pool.py`` (the worker pool and dispatcher), ``assembler.py`` (in-order batches from
  worker messages), ``iterator.py``, ``stats.py``, ``export.py``, ``autotune.py``, ``lead_staging.py``,
  ``first_batch_inline.py``, ``contracts.py`` (what a dataset may offer), ``messages.py``, ``errors.py``,
  ``_torch_compat.py`` (the one place that touches torch internals).
- ``epoch/``: the epoch's plan, pure functions of (seed, epoch, position): order, world split,
  index sources, resume state, progress.
- ``worker/``: what runs inside a worker process: its main loop, reads, per-sample stages,
  concurrent shard reads, the lifeline to the parent, the first-batch gate.
- ``shm/``: the shared-memory transport between them: storages, slots, segments, returns, rows,
  and the C heap's settings.

``stallfree`` re-exports ``DataLoader`` and ``get_worker_info``.
"""

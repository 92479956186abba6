"""``loader.stats()`` where users look: TensorBoard scalars and one JSON line per N steps.

One call in the training loop::

    from stallfree.loader.export import StatsExporter

    export = StatsExporter(loader, every=100, tensorboard="runs/exp1", jsonl="loader-stats.jsonl")
    for step, batch in enumerate(loader, 1):
        ...                      # train
        export.step(step)        # every 100th step: one stats() snapshot to both
    export.close()               # and once more for the steps since the last export

``tensorboard=`` takes a log directory (a ``SummaryWriter`` is opened there and closed by
``close()``) or your own ``SummaryWriter``, so the loader's curves sit beside your loss; ``jsonl=``
takes a path (appended to) or an open text stream such as ``sys.stdout``. Nested stats become flat
tags joined by ``/`` (``queue/mean_occupancy``, ``stages_s/fetch_s``, ``decode/images_per_s``);
TensorBoard tags get ``prefix/`` in front (``stallfree/data_wait_s``). Values are the loader's
counters as ``stats()`` gives them: totals since the loader was made, and ratios over that time.
Stats are per rank: give each rank its own file or log directory, or export on rank 0 only.

TensorBoard is optional (``pip install tensorboard``) and imported only when asked for.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

Scalar = int | float | str


class HasStats(Protocol):
    def stats(self) -> Mapping[str, Any]: ...


def flatten_stats(
    stats: Mapping[str, Any], *, numbers_only: bool = True, sep: str = "/"
) -> dict[str, Scalar]:
    """Nested stats as one level of scalars, keys joined by ``sep``, in ``stats``' order.

    Numbers are kept (bools as 0/1, numpy scalars as Python ones); strings only with
    ``numbers_only=False``; ``None``, NaN/inf and lists (``failed_keys``) are left out, because a
    chart or a strict JSON reader can hold none of them."""
    out: dict[str, Scalar] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(value, name + sep)
            elif isinstance(value, numbers.Integral):  # bools too: 0/1
                out[name] = int(value)
            elif isinstance(value, numbers.Real):
                if math.isfinite(value):
                    out[name] = float(value)
            elif isinstance(value, str) and not numbers_only:
                out[name] = value

    walk(stats, "")
    return out


def stats_json_line(stats: Mapping[str, Any], step: int, *, wall_time: float | None = None) -> str:
    """One strict-JSON object (no newline): ``step``, ``time`` (Unix seconds), then the flat stats
    with their strings (``path``, ``decode/backend``), so one line is one table row."""
    row: dict[str, Scalar] = {"step": int(step), "time": time.time() if wall_time is None else wall_time}
    for key, value in flatten_stats(stats, numbers_only=False).items():
        row.setdefault(key, value)  # "step" and "time" are the exporter's; stats() has neither
    return json.dumps(row, allow_nan=False, separators=(",", ":"))


def write_tensorboard(writer: Any, stats: Mapping[str, Any], step: int, *, prefix: str = "stallfree") -> int:
    """``writer.add_scalar`` for every number in ``stats`` at ``global_step=step``; returns how many."""
    scalars = flatten_stats(stats)
    for key, value in scalars.items():
        writer.add_scalar(f"{prefix}/{key}" if prefix else key, value, global_step=step)
    return len(scalars)


def open_summary_writer(log_dir: str | Path) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``log_dir``, with the install hint if missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch's module raises this when the tensorboard package is absent
        raise ImportError(
            f"TensorBoard export needs the tensorboard package: pip install tensorboard ({exc})"
        ) from exc
    return SummaryWriter(log_dir=str(log_dir))


class StatsExporter:
    """Exports ``source.stats()`` every ``every`` steps to TensorBoard and/or JSON lines.

    One ``stats()`` snapshot per export feeds both, so the two never disagree. Whatever this object
    opened (a log directory's writer, a file) it closes; writers and streams you pass stay yours."""

    def __init__(
        self,
        source: HasStats,
        *,
        every: int = 100,
        tensorboard: str | Path | Any | None = None,
        jsonl: str | Path | IO[str] | None = None,
        prefix: str = "stallfree",
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        if tensorboard is None and jsonl is None:
            raise ValueError(
                "nothing to export to: give tensorboard= (log dir or SummaryWriter) and/or jsonl="
            )
        self.source, self.every, self.prefix = source, every, prefix
        self._owned: list[Any] = []
        self._writer: Any = None
        if isinstance(tensorboard, (str, Path)):
            self._writer = open_summary_writer(tensorboard)
            self._owned.append(self._writer)
        elif tensorboard is not None:
            self._writer = tensorboard
        self._stream: IO[str] | None = None
        if isinstance(jsonl, (str, Path)):
            self._stream = open(jsonl, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
            self._owned.append(self._stream)
        elif jsonl is not None:
            self._stream = jsonl
        self._last_step: int | None = None  # the latest step() seen
        self._exported: int | None = None  # the step of the latest export
        self._closed = False

    def step(self, step: int) -> dict[str, Any] | None:
        """Call once per training step; exports on every ``every``-th step and returns that
        snapshot (None on the other steps)."""
        self._last_step = step
        return None if step % self.every else self.export(step)

    def export(self, step: int) -> dict[str, Any]:
        """Export one snapshot now, whatever the step; returns that snapshot."""
        stats = self.source.stats()
        self._exported = step
        if self._writer is not None:
            write_tensorboard(self._writer, stats, step, prefix=self.prefix)
            self._writer.flush()
        if self._stream is not None:
            self._stream.write(stats_json_line(stats, step) + "\n")
            self._stream.flush()
        return stats

    def close(self) -> None:
        """Export the last partial interval, then close what this exporter opened (idempotent).

        A run of 250 steps with ``every=100`` ends on step 250: without a final export the last
        50 steps (often the end of training, where an epoch boundary stall shows) would be in no
        chart or line, so ``close()`` exports once more at the last step seen if it was not an
        export step."""
        if self._closed:
            return
        self._closed = True
        if self._last_step is not None and self._last_step != self._exported:
            self.export(self._last_step)
        while self._owned:
            self._owned.pop().close()

    def __enter__(self) -> StatsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

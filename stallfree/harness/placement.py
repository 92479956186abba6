"""Where each batch was made: the report section of a loader with remote workers
(``stallfree bench --loader stallfree,stallfree-remote``).

The figures are the loader's own counters (``loader.stats()["remote"]``, kept by
``stallfree/engines/ray_pool.py``), one set per rank, read when the rank's loop stops: per remote
worker its node, batches, CPU-s, bytes sent and time in flight (dispatch to delivery); the local
workers as one row (the pool counts the batches it gives them together, not per process); and
the pool's re-issued batches, probes and lost workers. The counters cover the whole run, warm-up
included, and count a batch when it is made, so a run that stops mid-epoch shows the batches its
workers made ahead of the loop beside the ones the loop took.

Beside the plain ``stallfree`` loader, the same loader without remote workers, the section also
says what the remote workers changed: the job's stall share and samples/s with and without them.
This module builds the section's values; ``report.format_where_made`` writes its text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stallfree.harness.config import REMOTE_LOADER

LOCAL_LOADER = "stallfree"  # the same loader without remote workers
# The pool's counters a rank's summary carries over as they are (ray_pool.RemoteStats.as_dict).
_POOL_COUNTERS = (
    "reissued",
    "probes",
    "passed_over",
    "duplicates_dropped",
    "retried",
    "fell_back_to_local",
    "workers_lost",
)


def _local_label(workers: int) -> str:
    if workers <= 0:
        return "main process (num_workers=0)"
    return "local worker 0" if workers == 1 else f"local workers 0-{workers - 1}"


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def rank_where_made(rank: int, stats: Mapping[str, Any]) -> dict[str, Any] | None:
    """One rank's section from its loader's ``stats()`` (None: the loader had no remote workers).

    ``rows``: the local workers, then each remote worker by id: ``where`` (local | remote),
    ``label``, ``node``, ``batches``, ``share`` (of the batches made), ``cpu_s``, ``bytes_sent``,
    ``mean_in_flight_ms``, ``alive`` (None where the pool does not count it: local workers)."""
    remote = stats.get("remote")
    if not isinstance(remote, Mapping):
        return None
    made_local, made_remote = int(remote["batches_local"]), int(remote["batches_remote"])
    made = made_local + made_remote
    local_workers = int(stats.get("num_workers") or 0)
    rows: list[dict[str, Any]] = [
        {
            "where": "local",
            "worker": None,
            "label": _local_label(local_workers),
            "node": "trainer",
            "batches": made_local,
            "share": _share(made_local, made),
            "cpu_s": None,
            "bytes_sent": None,
            "mean_in_flight_ms": None,
            "alive": None,
        }
    ]
    # worker ids are ints in this process and strings once the report went through JSON
    for wid, w in sorted(remote["workers"].items(), key=lambda item: int(item[0])):
        batches = int(w["batches"])
        rows.append(
            {
                "where": "remote",
                "worker": int(wid),
                "label": f"remote worker {int(wid)}" + ("" if w.get("alive", True) else " (lost)"),
                "node": w["node"],
                "batches": batches,
                "share": _share(batches, made),
                "cpu_s": float(w["cpu_s"]),
                "bytes_sent": int(w["bytes_sent"]),
                "mean_in_flight_ms": 1e3 * float(w["in_flight_s"]) / batches if batches else None,
                "alive": bool(w.get("alive", True)),
            }
        )
    out: dict[str, Any] = {
        "rank": rank,
        "taken": int(stats.get("batches") or 0),
        "made": made,
        "made_local": made_local,
        "made_remote": made_remote,
        "remote_share": _share(made_remote, made),
        "rows": rows,
    }
    out.update({key: int(remote.get(key) or 0) for key in _POOL_COUNTERS})
    out["trainer_cpu_ms_per_batch"] = float(remote.get("trainer_cpu_ms_per_batch") or 0.0)
    out["bytes_per_batch"] = float(remote.get("bytes_per_batch") or 0.0)
    return out


def where_made(ranks: Sequence[tuple[int, Mapping[str, Any]]]) -> dict[str, Any] | None:
    """The section of one loader from each rank's ``(rank, stats)``: ``ranks`` (per rank, as
    :func:`rank_where_made`) and ``job`` (their sums); None when no rank had remote workers."""
    per_rank = [p for rank, stats in ranks if (p := rank_where_made(rank, stats)) is not None]
    if not per_rank:
        return None
    job: dict[str, Any] = {
        key: sum(p[key] for p in per_rank)
        for key in ("taken", "made", "made_local", "made_remote", *_POOL_COUNTERS)
    }
    job["remote_share"] = _share(job["made_remote"], job["made"])
    job["remote_workers"] = sum(1 for p in per_rank for row in p["rows"] if row["where"] == "remote")
    return {"job": job, "ranks": sorted(per_rank, key=lambda p: p["rank"])}


def remote_effect(loaders: Mapping[str, Any]) -> dict[str, Any] | None:
    """The job's stall and rate with remote workers (``stallfree-remote``) and without them
    (``stallfree``), when the bench ran both; None otherwise."""
    if LOCAL_LOADER not in loaders or REMOTE_LOADER not in loaders:
        return None
    without, with_ = loaders[LOCAL_LOADER]["job"], loaders[REMOTE_LOADER]["job"]
    rate_without = float(without["samples_per_s"])
    return {
        "without": LOCAL_LOADER,
        "with": REMOTE_LOADER,
        "stall_share_without": float(without["stall_share"]),
        "stall_share_with": float(with_["stall_share"]),
        "samples_per_s_without": rate_without,
        "samples_per_s_with": float(with_["samples_per_s"]),
        "speedup": float(with_["samples_per_s"]) / rate_without if rate_without > 0 else None,
    }

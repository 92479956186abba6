"""The bench report: a JSON-ready dict (with the environment it ran in), a plain-text table, and a
PNG with each rank's timeline of wait vs compute and a bar chart of stall per loader. A loader with
remote workers adds where each batch was made (placement.py builds it, format_where_made writes it).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stallfree.harness.metrics import job_summary
from stallfree.harness.placement import remote_effect, where_made

REPORT_VERSION = 1

# The decode column: each adapter's decode_label() (harness/loaders.py); the recipe's label is
# defined here so the table can explain it.
RECIPE_LABEL = "PIL recipe"
RECIPE_NOTE = (
    "decode: PIL recipe = per sample in the loader's workers: PIL JPEG decode, random resized crop, "
    "flip, normalise (harness/transforms.py)"
)
IMAGE_DECODE_NOTE = (
    "decode: ImageDecode = stallfree's batch decoder (backend and where it ran as shown; "
    "stallfree bench --decode recipe runs the PIL recipe instead)"
)


def environment(device: str = "cpu") -> dict[str, Any]:
    """Versions, cores and GPU of the machine the bench ran on."""
    import torch

    import stallfree

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "stallfree": stallfree.__version__,
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "gpu": None,
    }
    try:
        import psutil

        env["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        env["cpu_cores_physical"] = psutil.cpu_count(logical=False)
    except ImportError:
        pass
    for name in ("numpy", "webdataset", "pyarrow", "fsspec", "PIL"):
        try:
            module = __import__(name)
            env[name if name != "PIL" else "pillow"] = getattr(module, "__version__", "?")
        except ImportError:
            continue
    try:
        import nvidia.dali as dali

        env["dali"] = dali.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = {
            "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    return env


def phase_entry(result: dict[str, Any]) -> dict[str, Any]:
    """Per-rank summaries, the job summary and the timelines of one gathered phase."""
    ranks = [r["summary"] for r in result["ranks"]]
    waits = [row[1] * 1e3 for r in result["ranks"] for row in r["timeline"][_warmup_of(r) :]]
    entry = {
        "phase": result["phase"],
        "job": job_summary(ranks, waits),
        "ranks": ranks,
        "timeline": {str(r["summary"]["rank"]): r["timeline"] for r in result["ranks"]},
        "warmup_steps": _warmup_of(result["ranks"][0]),
        "stats": result["ranks"][0].get("stats", {}),
        "decode": result["ranks"][0].get("decode"),
    }
    made = where_made([(r["summary"]["rank"], r.get("stats") or {}) for r in result["ranks"]])
    if made is not None:  # a loader with remote workers: where each rank's batches were made
        entry["where_made"] = made
    return entry


def _warmup_of(rank_result: dict[str, Any]) -> int:
    return max(0, len(rank_result["timeline"]) - rank_result["summary"]["steps"])


def build_report(
    cfg: Any, loader_results: list[dict[str, Any]], skipped: dict[str, str], elapsed_s: float = 0.0
) -> dict[str, Any]:
    """The report dict: config, environment, one entry per loader, skipped loaders and why."""
    config = asdict(cfg)
    config.pop("storage_options", None)  # may hold credentials
    loaders = {r["phase"]["label"]: phase_entry(r) for r in loader_results}
    out = {
        "version": REPORT_VERSION,
        "config": config,
        "environment": environment(cfg.device),
        "loaders": loaders,
        "skipped": skipped,
        "elapsed_s": elapsed_s,
    }
    effect = remote_effect(loaders)
    if effect is not None:  # stallfree with and without remote workers, side by side
        out["remote_effect"] = effect
    return out


def _fmt_row(cells: list[str], widths: list[int]) -> str:
    """Text columns (the first and the last) left-aligned, figures right-aligned."""
    last = len(cells) - 1
    return "  ".join(
        c.ljust(w) if i in (0, last) else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ).rstrip()


def _cells(name: str, rank: str, figures: dict[str, Any], step_p50_ms: float, decode: str = "") -> list[str]:
    """One table row from a job or rank summary."""
    return [
        name,
        rank,
        f"{figures['samples_per_s']:.1f}",
        f"{100 * figures['stall_share']:.1f}",
        f"{figures['wait_p50_ms']:.1f}",
        f"{figures['wait_p99_ms']:.1f}",
        f"{step_p50_ms:.1f}",
        f"{figures['cpu_cores']:.2f}",
        decode,
    ]


def _world(cfg: dict[str, Any]) -> int:
    """Ranks of the run: ``nproc`` when the harness launched them, torchrun's world size otherwise."""
    return cfg["nproc"] if cfg.get("rank") is None else cfg.get("world_size") or 1


def _rank_label(rank: int, cfg: dict[str, Any]) -> str:
    """``3`` when every rank is on one node; ``3@node1`` when they span nodes (torchrun numbers
    each node's ranks contiguously, ``local_size`` per node)."""
    world = _world(cfg)
    local = cfg.get("local_size") or world
    return str(rank) if local >= world else f"{rank}@node{rank // local}"


def format_table(report: dict[str, Any], per_rank: bool = True) -> str:
    """A plain-text table: one row per loader (job figures), then per rank when asked."""
    head = [
        "loader",
        "rank",
        "samples/s",
        "stall %",
        "wait p50 ms",
        "wait p99 ms",
        "step p50 ms",
        "CPU cores",
        "decode",
    ]
    rows: list[list[str]] = []
    for name, entry in report["loaders"].items():
        step_p50 = max(r["step_p50_ms"] for r in entry["ranks"])
        rows.append(_cells(name, "job", entry["job"], step_p50, entry.get("decode") or "?"))
        if per_rank and len(entry["ranks"]) > 1:
            rows += [
                _cells("", _rank_label(r["rank"], report["config"]), r, r["step_p50_ms"])
                for r in entry["ranks"]
            ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = [_fmt_row(head, widths), "  ".join("-" * w for w in widths)]
    lines += [_fmt_row(r, widths) for r in rows]
    for name, entry in report["loaders"].items():
        worst = max(entry["ranks"], key=lambda r: r["stall_share"])
        spikes = worst.get("spikes") or {}
        if worst["stall_share"] > 0.02 and spikes.get("count") and spikes["share_of_wait"] > 0.5:
            every = f", about every {spikes['every_steps']:g} steps" if spikes.get("every_steps") else ""
            lines.append(
                f"{name}: {100 * spikes['share_of_wait']:.0f}% of rank {worst['rank']}'s wait is "
                f"{spikes['count']} spike(s) over {spikes['threshold_ms']:.0f} ms{every} (a boundary not read ahead)"
            )
    for name, entry in report["loaders"].items():
        stages = (entry.get("stats") or {}).get("stages_s") or {}
        batches = (entry.get("stats") or {}).get("batches") or 0
        if stages and batches:
            parts = ", ".join(f"{k.removesuffix('_s')} {1e3 * v / batches:.1f}" for k, v in stages.items())
            lines.append(f"{name} stages, ms per batch (rank 0, loader's own counters): {parts}")
    n, cfg = report.get("dataset_samples"), report["config"]
    per_epoch = n // (cfg["batch_size"] * _world(cfg)) if n else 0
    if n and per_epoch and cfg["warmup"] + cfg["steps"] > per_epoch:
        lines.append(
            f"note: an epoch is {per_epoch} steps ({n} samples), so the run crosses "
            f"{(cfg['warmup'] + cfg['steps']) // per_epoch} epoch boundary(ies); each restarts a loader's "
            f"read-ahead and shows as stall (use a larger dataset or fewer steps)"
        )
    decodes = {entry.get("decode") for entry in report["loaders"].values()}
    if RECIPE_LABEL in decodes:
        lines.append(RECIPE_NOTE)
    if any(d and d.startswith("ImageDecode") for d in decodes):
        lines.append(IMAGE_DECODE_NOTE)
    for name, reason in report.get("skipped", {}).items():
        lines.append(f"skipped {name}: {reason}")
    lines.append(
        f"{_world(cfg)} ranks, step {_step_label(cfg)}, batch {cfg['batch_size']}, workers {cfg['workers']}, {cfg['steps']} steps "
        f"(+{cfg['warmup']} warm-up); stall % = time blocked in next() / step time, job = worst rank"
    )
    return "\n".join(lines)


def _step_label(cfg: dict[str, Any]) -> str:
    if cfg["step"] == "model":
        return "model (TinyResNet fwd+bwd+SGD)"
    if cfg["step"] == "none":
        return "none (loader alone)"
    return f"{cfg['step']} {cfg['step_ms']:g} ms"


def timeline_spans(entry: dict[str, Any]) -> dict[int, list[list[float]]]:
    """A loader's measured timeline rows per rank, times re-zeroed at the rank's first measured
    step: ``[start_s, wait_s, compute_s, sync_s]``."""
    skip = entry.get("warmup_steps", 0)
    out: dict[int, list[list[float]]] = {}
    for rank_s, all_rows in entry["timeline"].items():
        rows = all_rows[skip:]
        t0 = rows[0][0] if rows else 0.0
        out[int(rank_s)] = [[row[0] - t0, *row[1:4]] for row in rows]
    return dict(sorted(out.items()))


def plot_figure(report: dict[str, Any]) -> Any:
    """The matplotlib figure ``write_plot`` saves: one timeline panel per loader (rows = ranks;
    wait red, compute blue, sync grey) and a bar chart of the job's stall share per loader.

    The timeline panels share one x-axis, from 0 to the end of the slowest loader's run: with an
    axis each, every panel filled its width and a loader that took twice as long for the same
    steps looked the same as the fast one."""
    from stallfree.extras import require

    matplotlib = require("matplotlib", "plot", "the bench plot (stallfree bench --plot)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaders = report["loaders"]
    if not loaders:
        raise ValueError("the report has no loader results to plot")
    n = len(loaders)
    fig, axes = plt.subplots(n + 1, 1, figsize=(11, 2.2 * n + 2.6), squeeze=False)
    colors = {"wait": "#d62728", "compute": "#1f77b4", "sync": "#aaaaaa"}
    spans_of = {name: timeline_spans(entry) for name, entry in loaders.items()}
    end = max(
        (row[0] + sum(row[1:4]) for spans in spans_of.values() for rows in spans.values() for row in rows),
        default=0.0,
    )
    timeline_axes = axes[:n, 0]
    for ax, (name, entry) in zip(timeline_axes, loaders.items(), strict=True):
        if ax is not timeline_axes[0]:
            ax.sharex(timeline_axes[0])
        for y, rows in spans_of[name].items():
            for kind, offset in (("wait", 0), ("compute", 1), ("sync", 2)):
                spans = [(row[0] + sum(row[1 : 1 + offset]), row[1 + offset]) for row in rows]
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=colors[kind], label=kind if y == 0 else None)
        ax.set_yticks(list(spans_of[name]))
        ax.set_ylabel("rank")
        decode = f", decode: {entry['decode']}" if entry.get("decode") else ""
        ax.set_title(
            f"{name}: stall {100 * entry['job']['stall_share']:.1f}% (worst rank), "
            f"{entry['job']['samples_per_s']:.1f} samples/s{decode}",
            fontsize=10,
        )
        ax.legend(loc="upper right", fontsize=8, ncol=3)
    timeline_axes[0].set_xlim(0.0, end * 1.02 if end > 0 else 1.0)
    timeline_axes[-1].set_xlabel("seconds since the end of warm-up (one axis for every loader)")
    bar = axes[n, 0]
    names = list(loaders)
    bar.bar(names, [100 * loaders[k]["job"]["stall_share"] for k in names], color="#d62728")
    bar.set_ylabel("stall % (worst rank)")
    bar.set_title("time blocked on data, per loader", fontsize=10)
    fig.tight_layout()
    return fig


def write_plot(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Save ``plot_figure(report)`` as a PNG at ``path``."""
    fig = plot_figure(report)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=90)
    finally:
        plt.close(fig)
    return out


def format_analysis(analysis: dict[str, Any]) -> str:
    """The --analyze section: rates, stall split, what-if check and advice."""
    r, s, w = analysis["rates"], analysis["stall"], analysis["whatif"]
    storage = r["storage_bytes_per_s"]
    lines = [
        f"analysis of {analysis['loader']} (samples/s): ingestion ceiling G {r['ingestion_ceiling_G']:.1f}, "
        f"prep P {r['prep_P']:.1f}, fetch+prep {r['fetch_plus_prep']:.1f}, storage S "
        + (
            f"{r['storage_fetch_S']:.1f} ({storage / 1e6:.2f} MB/s)"
            if storage != float("inf")
            else "not limiting"
        ),
        f"cold run: worst-rank stall {100 * s['measured_stall_share']:.1f}%; differential split of its time "
        f"per sample: fetch {100 * s['fetch_stall_share']:.1f}%, prep + hand-off {100 * s['prep_stall_share']:.1f}%",
        f"what-if cache {100 * w['cache_share']:.0f}% ({w['cache_bytes'] / 1e6:.1f} MB): predicted "
        f"{w['predicted_samples_per_s']:.1f} samples/s, measured {w['measured_samples_per_s']:.1f} "
        f"(error {100 * (w['error'] or 0):.1f}%)",
    ]
    if w.get("note"):
        lines.append(f"note: {w['note']}")
    given = analysis.get("whatif_given_storage")
    if given:
        lines.append(
            f"what-if storage {given['storage_bytes_per_s'] / 1e6:.1f} MB/s with that cache: "
            f"{given['predicted_samples_per_s']:.1f} samples/s predicted"
        )
    lines += [f"advice: {tip}" for tip in analysis["advice"]]
    return "\n".join(lines)


def format_tune(tune: dict[str, Any]) -> str:
    """The --tune section: one row per setting, then the pick."""
    lines = [
        f"tune {tune['loader']} (target stall <= {100 * tune['target_stall']:.1f}%):",
        "  workers  prefetch  stall %  CPU cores  samples/s",
    ]
    for row in tune["rows"]:
        lines.append(
            f"  {row['workers']:>7}  {row['prefetch'] if row['prefetch'] else '-':>8}  "
            f"{100 * row['stall_share']:>7.1f}  {row['cpu_cores']:>9.2f}  {row['samples_per_s']:>9.1f}"
        )
    best = tune["best"]
    verdict = "removes stall" if tune["removes_stall"] else "least stall (none meets the target)"
    lines.append(
        f"best: workers={best['workers']} prefetch={best['prefetch'] or '-'}: {verdict} at "
        f"{best['cpu_cores']:.2f} CPU cores"
    )
    return "\n".join(lines)


_WHERE_HEAD = ["loader", "rank", "worker", "node", "batches", "share %", "CPU-s", "MB sent", "in flight ms"]
_WHERE_TEXT_COLUMNS = (0, 2, 3)  # left-aligned; the figures right-aligned


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _size(n: float) -> str:
    """Bytes as kB below a megabyte, else MB (decimal units, as the MB sent column)."""
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def _where_cells(loader: str, rank: str, row: Mapping[str, Any]) -> list[str]:
    sent = row["bytes_sent"]
    return [
        loader,
        rank,
        row["label"],
        str(row["node"]),
        str(row["batches"]),
        f"{100 * row['share']:.1f}",
        _opt(row["cpu_s"], ".3f"),
        _opt(None if sent is None else sent / 1e6, ".2f"),
        _opt(row["mean_in_flight_ms"], ".1f"),
    ]


def _where_summary(loader: str, who: str, p: Mapping[str, Any]) -> str:
    ahead = p["made"] - p["taken"]
    made_ahead = f", {ahead} of them ahead of the loop (not taken when it stopped)" if ahead > 0 else ""
    return (
        f"{loader} {who}: the loop took {p['taken']} batches; the workers made {p['made']} "
        f"({p['made_remote']} remote, {100 * p['remote_share']:.1f}%){made_ahead}; re-issued "
        f"{p['reissued']}, probes {p['probes']}, passed over {p['passed_over']}, lost workers "
        f"{p['workers_lost']}"
    )


def format_where_made(report: Mapping[str, Any], per_rank: bool = True) -> str:
    """The text section: per loader with remote workers, one row per worker (per rank), a
    summary line per rank (and the job's over several ranks), and the stall with and without
    remote workers; the empty string when no loader had remote workers."""
    cfg = report.get("config")

    def rank(r: int) -> str:
        return _rank_label(r, cfg) if cfg else str(r)

    rows: list[list[str]] = []
    notes: list[str] = []
    for name, entry in report["loaders"].items():
        section = entry.get("where_made")
        if not section:
            continue
        several = len(section["ranks"]) > 1
        for p in section["ranks"]:
            if several and not per_rank:
                break
            for row in p["rows"]:
                rows.append(_where_cells(name, rank(p["rank"]), row))
            notes.append(
                _where_summary(name, f"rank {rank(p['rank'])}", p)
                + (
                    f"; a remote batch cost the trainer {p['trainer_cpu_ms_per_batch']:.2f} ms CPU "
                    f"and brought {_size(p['bytes_per_batch'])}"
                    if p["made_remote"]
                    else ""
                )
            )
        if several:
            notes.append(_where_summary(name, f"job ({len(section['ranks'])} ranks)", section["job"]))
    if not notes:
        return ""
    lines = ["where the batches were made (the loaders' own counters, whole run, warm-up included):"]
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_WHERE_HEAD)]

        def fmt(cells: list[str]) -> str:
            return "  ".join(
                c.ljust(w) if i in _WHERE_TEXT_COLUMNS else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        lines += [fmt(_WHERE_HEAD), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]
    lines += notes
    effect = report.get("remote_effect")
    if effect:
        speedup = f" ({effect['speedup']:.2f}x)" if effect.get("speedup") else ""
        lines.append(
            f"stall with remote workers: {100 * effect['stall_share_with']:.1f}% ({effect['with']}) vs "
            f"{100 * effect['stall_share_without']:.1f}% without ({effect['without']}), job, worst rank; "
            f"samples/s {effect['samples_per_s_with']:.1f} vs {effect['samples_per_s_without']:.1f}{speedup}"
        )
    lines.append(
        "local workers are one row: the pool counts the batches it gives them together; CPU-s, MB sent "
        "and time in flight (dispatch to delivery, mean per batch) are the remote workers'"
    )
    return "\n".join(lines)

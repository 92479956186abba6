"""The AU bench's report: a table (most emulated accelerators at the threshold, per loader, and
the AU of every N run) and a PNG of AU against N per loader with the threshold drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def format_au_table(report: dict[str, Any]) -> str:
    """Plain text: the workload line, one row per loader, then each loader's AU per N."""
    wl = report["workload"]
    lines = [
        f"workload {wl['name']} on {wl['accelerator']}: batch {wl['batch_size']}, "
        f"{wl['record_bytes'] / 1e6:.3g} MB records (1/{wl['scale']} of the config's), "
        f"compute {wl['compute_s'] * 1e3:.4g} ms/batch, AU threshold {wl['au_threshold']:.0%}",
        f"  ({wl['config']}{'; ' + wl['derived'] if wl['derived'] else ''})",
        f"  one emulated accelerator reads {wl['samples_per_s_per_accelerator']:.0f} samples/s, "
        f"{wl['bytes_per_s_per_accelerator'] / 1e6:.0f} MB/s at this scale",
        "",
    ]
    head = ["loader", "max accelerators", "real equivalent", "MB/s at max", "AU at max", "AU per N"]
    rows = []
    for name, entry in report["loaders"].items():
        at_max = next((p for p in entry["probes"] if p["n"] == entry["max_accelerators"]), None)
        per_n = " ".join(f"{p['n']}:{p['au']:.0%}" for p in entry["probes"])
        rows.append(
            [
                name,
                f"{entry['max_accelerators']}{'+' if entry['capped'] else ''}",
                f"{entry['real_equivalent']:.3g}",
                f"{at_max['mb_per_s']:.0f}" if at_max else "-",
                f"{at_max['au']:.1%}" if at_max else "-",
                per_n,
            ]
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append(
            "  ".join(
                c.ljust(w) if i in (0, 5) else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    for name, why in report.get("skipped", {}).items():
        lines.append(f"{name}: skipped ({why})")
    lines.append("")
    lines.append(
        "max accelerators: the most emulated accelerators (ranks) whose mean AU met the threshold "
        "('+': still met at --max-accelerators); real equivalent: that / the scale (bandwidth terms)"
    )
    return "\n".join(lines)


def write_au_plot(report: dict[str, Any], path: str | Path) -> None:
    """AU against N per loader, the threshold as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = report["workload"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, entry in report["loaders"].items():
        probes = entry["probes"]
        ax.plot([p["n"] for p in probes], [100 * p["au"] for p in probes], marker="o", label=name)
    ax.axhline(
        100 * wl["au_threshold"], color="grey", linestyle="--", label=f"threshold {wl['au_threshold']:.0%}"
    )
    ax.set_xlabel("emulated accelerators (ranks)")
    ax.set_ylabel("accelerator utilisation, %")
    ax.set_ylim(0, 105)
    ax.set_title(f"{wl['name']} / {wl['accelerator']}, records 1/{wl['scale']} of the config's")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)

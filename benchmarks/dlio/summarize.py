"""The table of benchmarks/dlio/run_dlio.sh's runs: DLIO's own AU and throughput per loader.

python benchmarks/dlio/summarize.py benchmarks/out/dlio
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(out: Path) -> list[dict[str, object]]:
    found = []
    for summary in sorted(out.glob("*-n*/summary.json")):
        name = summary.parent.name  # <workload>-<loader>-n<N>
        workload, loader, ranks = name.rsplit("-", 2)
        metric = json.loads(summary.read_text())["metric"]
        found.append(
            {
                "workload": workload,
                "loader": loader,
                "ranks": int(ranks[1:]),
                "au_mean": metric["train_au_mean_percentage"],
                "au_per_epoch": metric["train_au_percentage"],
                "samples_per_s": metric["train_throughput_mean_samples_per_second"],
                "mb_per_s": metric["train_io_mean_MB_per_second"],
                "verdict": metric["train_au_meet_expectation"],
            }
        )
    return found


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "benchmarks/out/dlio")
    table = rows(out)
    failed = sorted(
        p.name[: -len(".log")]
        for p in out.glob("*-n*.log")
        if not (p.with_suffix("") / "summary.json").exists()
    )
    print(
        "| workload | loader | ranks | DLIO AU % (mean of epochs) | AU % per epoch | samples/s | MB/s | DLIO verdict |"
    )
    print("|---|---|---:|---:|---|---:|---:|---|")
    for r in table:
        epochs = ", ".join(f"{v:.1f}" for v in r["au_per_epoch"])
        print(
            f"| {r['workload']} | {r['loader']} | {r['ranks']} | {r['au_mean']:.1f} | {epochs} | "
            f"{r['samples_per_s']:.0f} | {r['mb_per_s']:.0f} | {r['verdict']} |"
        )
    for name in failed:
        print(f"no summary for {name} (see its .log)")
    (out / "summary-table.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

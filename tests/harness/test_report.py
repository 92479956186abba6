"""The bench report says which decode each loader ran (table column, notes, plot titles), and its
PNG puts every loader's timeline on one x-axis (issue 19.7)."""

from __future__ import annotations

import pytest

from stallfree.harness.report import RECIPE_NOTE, format_table, plot_figure, timeline_spans, write_plot

pytest.importorskip("matplotlib")


def _entry(stall: float, rate: float, decode: str | None, step_s: float, steps: int = 4, warmup: int = 1):
    """A loader's report entry with two ranks whose steps take ``step_s`` each."""
    figures = {
        "samples_per_s": rate,
        "stall_share": stall,
        "wait_p50_ms": 1.0,
        "wait_p99_ms": 2.0,
        "cpu_cores": 0.5,
    }
    ranks = [{**figures, "rank": r, "step_p50_ms": 1e3 * step_s} for r in (0, 1)]
    start = 100.0  # absolute perf_counter times, as the runner records them
    timeline = {
        str(r): [
            [start + i * step_s, step_s * stall, step_s * (1 - stall), 0.0] for i in range(warmup + steps)
        ]
        for r in (0, 1)
    }
    return {"job": figures, "ranks": ranks, "timeline": timeline, "warmup_steps": warmup, "decode": decode}


def _report() -> dict:
    return {
        "config": {
            "nproc": 2,
            "rank": None,
            "step": "sleep",
            "step_ms": 10.0,
            "batch_size": 8,
            "workers": 1,
            "steps": 4,
            "warmup": 1,
        },
        "loaders": {
            "stallfree": _entry(0.1, 400.0, "ImageDecode cpu in workers", 0.05),
            "torch": _entry(0.6, 100.0, "PIL recipe", 0.2),
            "old": _entry(0.0, 50.0, None, 0.1),  # a report from before the column
        },
        "skipped": {},
    }


def test_table_names_each_loaders_decode_and_explains_the_labels():
    lines = format_table(_report(), per_rank=False).splitlines()
    assert lines[0].split()[-1] == "decode"
    rows = {line.split()[0]: line for line in lines[2:5]}
    assert rows["stallfree"].endswith("0.50  ImageDecode cpu in workers")
    assert rows["torch"].endswith("0.50  PIL recipe")
    assert rows["old"].endswith("0.50  ?")
    assert RECIPE_NOTE in lines
    assert any(line.startswith("decode: ImageDecode = stallfree's batch decoder") for line in lines)


def test_timelines_are_rezeroed_after_warmup():
    spans = timeline_spans(_entry(0.5, 1.0, None, 0.2))
    assert list(spans) == [0, 1]
    assert [row[0] for row in spans[0]] == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert spans[0][0][1:] == pytest.approx([0.1, 0.1, 0.0])


def test_every_timeline_panel_shares_the_slowest_loaders_x_axis(tmp_path):
    import matplotlib.pyplot as plt

    fig = plot_figure(_report())
    try:
        timelines, bars = fig.axes[:3], fig.axes[3]
        end = 4 * 0.2  # torch: 4 measured steps of 0.2 s, the slowest run
        for ax in timelines:
            assert ax.get_xlim() == pytest.approx((0.0, end * 1.02))
        assert timelines[0].get_shared_x_axes().joined(timelines[0], timelines[2])
        assert bars.get_xlim() != timelines[0].get_xlim()  # the bar chart keeps its own categories
        titles = [ax.get_title() for ax in timelines]
        assert (
            titles[0]
            == "stallfree: stall 10.0% (worst rank), 400.0 samples/s, decode: ImageDecode cpu in workers"
        )
        assert titles[1] == "torch: stall 60.0% (worst rank), 100.0 samples/s, decode: PIL recipe"
        assert titles[2] == "old: stall 0.0% (worst rank), 50.0 samples/s"
    finally:
        plt.close(fig)
    png = write_plot(_report(), tmp_path / "sub" / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_empty_report_is_refused():
    with pytest.raises(ValueError, match="no loader results to plot"):
        plot_figure({"loaders": {}})

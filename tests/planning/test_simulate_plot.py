"""`hetrain simulate`'s figure: every series in a legend is drawn even at one plotted size, and no legend
covers the ringed point of the strategy `hetrain plan` chooses."""

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hetrain.cli import simulate

IDEAL = "ideal (sum of devices)"


def _row(devices, strategy, samples, ideal, chosen=False):
    return {"devices": devices, "strategy": strategy, "compression": "none", "samples_per_s": samples,
            "ideal_samples_per_s": ideal, "scaling_efficiency": round(samples / ideal, 4), "chosen": chosen}


ONE_SIZE = [_row(8, "zero3", 4.33, 6.526), _row(8, "pipeline", 4.645, 6.526, True), _row(8, "hybrid", 4.394, 6.526)]
SIZES = [_row(n, s, v * n, 1.2 * n, s == "balanced") for n in (2, 4, 8, 16) for s, v in (("ddp", 0.6), ("balanced", 1.1))]


def _drawn(monkeypatch, rows, tmp_path) -> Figure:
    """The figure `hetrain simulate` saves for `rows`, drawn."""
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    simulate._plot(rows, str(tmp_path / "s.png"), "test")
    (fig,) = saved
    FigureCanvasAgg(fig).draw()   # closed by pyplot: draw it on a canvas of its own
    return fig


@pytest.mark.parametrize("rows", [ONE_SIZE, SIZES], ids=["one size", "four sizes"])
def test_the_ideal_series_is_visible_at_a_single_size(monkeypatch, tmp_path, rows):
    fig = _drawn(monkeypatch, rows, tmp_path)
    (ideal,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == IDEAL]
    assert ideal.get_marker() not in (None, "", " ", "None"), "a dashed line through one point draws nothing"


@pytest.mark.parametrize("rows", [ONE_SIZE, SIZES], ids=["one size", "four sizes"])
def test_no_legend_covers_the_ringed_chosen_point(monkeypatch, tmp_path, rows):
    fig = _drawn(monkeypatch, rows, tmp_path)
    renderer = fig.canvas.get_renderer()
    for ax, key in zip(fig.axes, ("samples_per_s", "scaling_efficiency")):
        legend = ax.get_legend().get_window_extent(renderer)
        ring = 0.5 * (160 ** 0.5) * fig.dpi / 72 + 2   # the ring's radius in pixels (s=160 pt^2), and its edge
        for r in (r for r in rows if r["chosen"]):
            x, y = ax.transData.transform((r["devices"], r[key]))
            clear = (x + ring < legend.x0 or x - ring > legend.x1 or y + ring < legend.y0 or y - ring > legend.y1)
            assert clear, (key, r["devices"], (x, y), legend)

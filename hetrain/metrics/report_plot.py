"""The run report's figure: per-rank throughput and shares over steps, time by cause, loss."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hetrain.metrics.report import CAUSES, RankRun, loss_series, split_change_steps  # noqa: E402

SMOOTH = 5


def _smooth(values: list[float], window: int = SMOOTH) -> np.ndarray:
    """Trailing mean over `window` steps (fewer at the start), so one slow step does not hide the trend."""
    v = np.asarray(values, dtype=float)
    c = np.cumsum(np.insert(v, 0, 0.0))
    n = np.minimum(np.arange(1, len(v) + 1), window)
    return (c[1:] - c[np.arange(1, len(v) + 1) - n]) / n


def _mark_splits(ax, steps: list[int]) -> None:
    """A dotted line between the last step of the old split and the first of the new one."""
    for i, step in enumerate(steps):
        ax.axvline(step + 0.5, color="0.5", linestyle=":", linewidth=1, label="split changed" if i == 0 else None)


def _colors(n: int) -> list:
    """One colour per rank, none repeated: matplotlib's cycle repeats after 10 lines."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("turbo")(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def figure(runs: dict[int, RankRun], title: str):
    """The report's figure; it grows with the ranks, so 32 ranks' bars and legend stay readable."""
    splits = split_change_steps(runs)
    parts = [part for run in runs.values() for part in run.parts()]   # a rank and device each
    many = len(runs) > 10
    height = max(8.5, 2 * (1.4 + 0.24 * len(parts)))
    fig, axes = plt.subplots(2, 2, figsize=(14.5 if many else 13, height), layout="constrained")
    ax_rate, ax_share, ax_time, ax_loss = axes.ravel()
    colors = dict(zip(runs, _colors(len(runs))))
    for rank, run in runs.items():
        label = f"rank {rank} ({run.device})"
        points = run.samples_per_second()
        if points:
            steps, rates = zip(*points)
            ax_rate.plot(steps, _smooth(list(rates)), label=label, linewidth=1.5, color=colors[rank])
        shares = run.shares()
        if shares:
            steps, values = zip(*shares)
            ax_share.step(steps, np.asarray(values) * 100, where="post", label=label, linewidth=1.5,
                          color=colors[rank])
    for ax, ylabel in ((ax_rate, f"samples/s (mean of {SMOOTH} steps)"), (ax_share, "share of global batch (%)")):
        _mark_splits(ax, splits)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not many:
            ax.legend(fontsize=8)
    if many:   # one legend for both panels, beside them, so the lines stay visible
        handles, labels = ax_rate.get_legend_handles_labels() if ax_rate.lines else ax_share.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right upper", fontsize=7, ncol=-(-len(labels) // 60))
    ax_rate.set_title("Throughput per rank")
    ax_share.set_title("Share of each global batch")
    ax_share.set_ylim(bottom=0)

    left = np.zeros(len(parts))
    sep = " " if len(parts) > 10 else "\n"
    for cause, color in zip(CAUSES, ("tab:green", "tab:red", "tab:orange", "tab:gray", "tab:purple")):
        fractions = []
        for part in parts:
            t = part.time_by_cause()
            total = sum(t.values())
            fractions.append(100 * t[cause] / total if total else 0.0)
        bars = ax_time.barh([f"rank {p.rank}{sep}{p.device}" for p in parts], fractions, left=left, label=cause,
                            color=color)
        ax_time.bar_label(bars, labels=[f"{f:.0f}%" if f >= 8 else "" for f in fractions], label_type="center",
                          fontsize=7 if len(parts) > 10 else None)
        left += np.asarray(fractions)
    if len(parts) > 10:
        ax_time.tick_params(axis="y", labelsize=7)
    ax_time.set_xlabel("% of step time (steps after each process's first)")
    ax_time.set_xlim(0, 100)
    ax_time.invert_yaxis()
    ax_time.set_title("Where each rank's step time goes")
    ax_time.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 * 8.5 / height),
                   ncol=3 if many else len(CAUSES))

    loss = loss_series(runs)
    if loss:
        steps, values = zip(*loss)
        ax_loss.plot(steps, values, color="black", linewidth=1.2)
    _mark_splits(ax_loss, splits)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("global mean loss")
    ax_loss.set_title("Loss")
    ax_loss.grid(alpha=0.3)

    fig.suptitle(title)
    return fig


def draw(runs: dict[int, RankRun], out: Path, title: str) -> Path:
    """Write the report PNG to `out`."""
    fig = figure(runs, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

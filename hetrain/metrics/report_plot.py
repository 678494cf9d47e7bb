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


def draw(runs: dict[int, RankRun], out: Path, title: str) -> Path:
    """Write the report PNG to `out`."""
    splits = split_change_steps(runs)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), constrained_layout=True)
    ax_rate, ax_share, ax_time, ax_loss = axes.ravel()
    for rank, run in runs.items():
        label = f"rank {rank} ({run.device})"
        points = run.samples_per_second()
        if points:
            steps, rates = zip(*points)
            ax_rate.plot(steps, _smooth(list(rates)), label=label, linewidth=1.5)
        shares = run.shares()
        if shares:
            steps, values = zip(*shares)
            ax_share.step(steps, np.asarray(values) * 100, where="post", label=label, linewidth=1.5)
    for ax, ylabel in ((ax_rate, f"samples/s (mean of {SMOOTH} steps)"), (ax_share, "share of global batch (%)")):
        _mark_splits(ax, splits)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_rate.set_title("Throughput per rank")
    ax_share.set_title("Share of each global batch")
    ax_share.set_ylim(bottom=0)

    parts = [part for run in runs.values() for part in run.parts()]   # a rank and device each
    left = np.zeros(len(parts))
    for cause, color in zip(CAUSES, ("tab:green", "tab:red", "tab:orange", "tab:gray", "tab:purple")):
        fractions = []
        for part in parts:
            t = part.time_by_cause()
            total = sum(t.values())
            fractions.append(100 * t[cause] / total if total else 0.0)
        bars = ax_time.barh([f"rank {p.rank}\n{p.device}" for p in parts], fractions, left=left, label=cause,
                            color=color)
        ax_time.bar_label(bars, labels=[f"{f:.0f}%" if f >= 8 else "" for f in fractions], label_type="center")
        left += np.asarray(fractions)
    ax_time.set_xlabel("% of step time (steps after each process's first)")
    ax_time.set_xlim(0, 100)
    ax_time.invert_yaxis()
    ax_time.set_title("Where each rank's step time goes")
    ax_time.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(CAUSES))

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
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

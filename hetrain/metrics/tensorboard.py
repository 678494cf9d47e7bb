"""The run log as TensorBoard scalars (optional: needs the `tensorboard` package)."""

from __future__ import annotations

from pathlib import Path

from hetrain.errors import HetrainError
from hetrain.metrics.report import RankRun

SUFFIX = ".hetrain-report"   # marks the event files an export writes, so the next export replaces them
SCALARS = ("loss", "step_seconds", "compute_seconds", "data_wait_seconds", "waiting_seconds", "script_seconds",
           "checkpoint_seconds", "share", "mfu")


def write_scalars(runs: dict[int, RankRun], log_dir: Path) -> Path:
    """One TensorBoard run per rank under `log_dir` (rank-N), a scalar per figure per step. A later export
    replaces an earlier one's files (TensorBoard would show both, every point twice); event files the
    script wrote there itself are kept."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise HetrainError("--tensorboard needs the tensorboard package; pip install tensorboard") from None
    for rank, run in runs.items():
        for old in (log_dir / f"rank-{rank}").glob(f"events.out.tfevents.*{SUFFIX}"):
            old.unlink()
        writer = SummaryWriter(log_dir=str(log_dir / f"rank-{rank}"), filename_suffix=SUFFIX)
        try:
            for s in run.steps:
                for name in SCALARS:
                    if s.get(name) is not None:
                        writer.add_scalar(f"hetrain/{name}", float(s[name]), global_step=s["step"], walltime=s["time"])
                if s.get("step_seconds"):
                    writer.add_scalar("hetrain/samples_per_second", s["samples"] / s["step_seconds"],
                                      global_step=s["step"], walltime=s["time"])
        finally:
            writer.close()
    return log_dir

"""A rank's running figures, folded from the step and checkpoint records: pure, in memory, no I/O.

The exporter reads a copy of this state when Prometheus scrapes; the training loop only adds to it.
Step, compute and waiting seconds are summed over the same steps (every step but a process's
first, which has no previous step to measure from), so compute + waiting = step time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from hetrain.metrics.events import CheckpointRecord, StepRecord


@dataclass
class RankState:
    """Totals since this process started, and the last step's gauges (None until seen)."""

    precision: str | None = None
    emulated: bool = False
    step: int | None = None
    steps: int = 0
    timed_steps: int = 0
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    # "checkpoint" appears once a checkpoint save has held the loop (a job without checkpoints has none)
    wait_seconds: dict[str, float] = field(default_factory=lambda: {"ranks": 0.0, "data": 0.0})
    script_seconds: float = 0.0   # the script's own time between steps (StepRecord.script_seconds)
    samples: int = 0
    items: int = 0
    share: int | None = None
    share_ratio: float | None = None
    split_changes: int = 0
    comm_bytes: dict[str, float] = field(default_factory=dict)
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped_steps: int = 0
    mfu: float | None = None
    checkpoints: int = 0
    checkpoint_blocking_seconds: float = 0.0
    checkpoint_save_seconds: float = 0.0
    checkpoint_bytes: int | None = None
    restarts: int = 0

    def add_step(self, r: StepRecord, mfu: float | None) -> None:
        self.precision, self.emulated, self.step = r.precision, r.emulated, r.step
        self.steps += 1
        if r.step_seconds is not None:
            self.timed_steps += 1
            self.step_seconds += r.step_seconds
            self.compute_seconds += r.compute_seconds
            self.wait_seconds["data"] += r.data_wait_seconds
            self.wait_seconds["ranks"] += r.waiting_seconds or 0.0
            if r.checkpoint_seconds:
                self.wait_seconds["checkpoint"] = self.wait_seconds.get("checkpoint", 0.0) + r.checkpoint_seconds
            self.script_seconds += r.script_seconds
        self.samples += r.samples
        self.items += r.items
        self.share = r.share
        full = sum(r.shares) if r.shares else 0
        self.share_ratio = r.share / full if full else None
        self.split_changes += int(r.split_changed)
        for level, nbytes in r.comm_bytes.items():
            self.comm_bytes[level] = self.comm_bytes.get(level, 0.0) + nbytes
        if r.loss is not None:
            self.loss = r.loss
        if r.grad_norm is not None:
            self.grad_norm = r.grad_norm
        self.loss_scale = r.loss_scale
        self.skipped_steps += int(r.skipped)   # this process's own: a counter restarts at zero with it
        if mfu is not None:
            self.mfu = mfu

    def add_checkpoint(self, c: CheckpointRecord) -> None:
        self.checkpoints += 1
        self.checkpoint_blocking_seconds += c.blocking_seconds
        self.checkpoint_save_seconds += c.total_seconds
        self.checkpoint_bytes = c.bytes

    def copy(self) -> "RankState":
        return copy.deepcopy(self)

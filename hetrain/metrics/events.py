"""What a Session reports after each step and each checkpoint, for metrics, run logs and tools.

Observers (the Prometheus exporter, the JSONL run log) receive these records; they never reach
into the Session. Every figure is this rank's own unless its name says `global_`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPLIT_REASONS = ("balance", "try", "back")
"""Why the balancer changed the split: a re-split on the ranks' measured speeds; a rank at 0 samples given one
sample to measure it again (`min_share` 0); the split it came from again, that try finding the rank too slow."""


@dataclass(frozen=True)
class StepRecord:
    """One finished step on one rank."""

    step: int                      # steps completed, this one included
    rank: int
    world_size: int
    device: str                    # the plan's device name this rank runs (catalog name or 'cpu')
    precision: str
    share: int                     # samples of a full global batch this rank takes under the current split
    samples: int                   # samples this rank computed in this step
    items: int                     # items (tokens, or samples when num_items was not given) in this step
    global_samples: int
    global_items: int
    step_seconds: float | None     # wall time since the previous step ended (None for the first)
    compute_seconds: float         # forward, backward and optimizer (emulated speed included)
    data_wait_seconds: float       # waiting for this step's batch
    optimizer_seconds: float
    loss: float | None             # global item-weighted mean loss of the step, when backward saw one
    grad_norm: float | None        # total gradient norm, when clip_grad_norm_ was called
    loss_scale: float
    skipped: bool                  # the update was skipped (a non-finite gradient on some rank)
    skipped_total: int
    shares: tuple[int, ...] = ()   # the split this step used (when split_changed, the new one starts next step)
    split_changed: bool = False
    comm_bytes: dict[str, float] = field(default_factory=dict)  # bytes this rank sent this step, by level
    emulated: bool = False
    script_seconds: float = 0.0    # the script's own time between steps (logging, evaluation): from the
    #                                previous step() returning to this step's first forward, between its
    #                                micro-batches and from its last backward to step(), less the data wait
    checkpoint_seconds: float = 0.0  # the loop held by the checkpoint save the previous step() made (its
    #                                  blocking part), which falls in this step's wall time
    model_flops: float | None = None  # forward and backward FLOPs of this step's batch, when counted
    split_reason: str | None = None   # where split_changed, why (SPLIT_REASONS)

    @property
    def waiting_seconds(self) -> float | None:
        """Time waiting on other ranks: what the step took beyond compute, data, the script's own time
        and a checkpoint save."""
        if self.step_seconds is None:
            return None
        return max(0.0, self.step_seconds - self.compute_seconds - self.data_wait_seconds - self.script_seconds
                   - self.checkpoint_seconds)


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint written by the session."""

    step: int
    blocking_seconds: float        # time the training loop was held
    total_seconds: float           # until committed on disk (background saves finish later)
    bytes: int

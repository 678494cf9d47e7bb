"""Re-split the global batch while the job runs, from every rank's measured speed.

Every ``interval`` steps each rank contributes its mean compute seconds per sample over the
interval; the ranks all-gather these, average them exponentially with earlier intervals, and each
computes the same new split with the planner's split function (identical inputs, a pure function: every rank agrees, DESIGN.md invariant 4).
At the fixed point of repeated re-splits every rank's step takes the same time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetrain.planning.batch_split import RankCost, rebalance
from hetrain.planning.plan import BalancePlan

log = logging.getLogger("hetrain.balance")


@dataclass
class SplitChange:
    step: int
    old: list[int]
    new: list[int]
    predicted_old_s: float
    predicted_new_s: float


@dataclass
class Balancer:
    """Collects (samples, seconds) per step and re-splits every ``config.interval`` steps."""

    config: BalancePlan
    shares: list[int]
    warmup_steps: int = 1
    _samples: int = 0
    _seconds: float = 0.0
    _steps_seen: int = 0
    per_sample_s: list[float] | None = None   # the last all-gathered figures
    changes: list[SplitChange] = field(default_factory=list)

    def record(self, samples: int, seconds: float) -> None:
        """One step of this rank: how many samples it computed, in how many compute seconds."""
        self._steps_seen += 1
        if self._steps_seen <= self.warmup_steps or samples <= 0:
            return  # the first steps pay for allocation and warm-up, not for samples
        self._samples += samples
        self._seconds += seconds

    def due(self, step: int) -> bool:
        return self.config.enabled and step > 0 and step % self.config.interval == 0

    def exchange(self, device: torch.device, group=None) -> list[float]:
        """All-gather every rank's mean seconds per sample (nan where a rank has no measurement)."""
        local = self._seconds / self._samples if self._samples > 0 else math.nan
        world = dist.get_world_size(group)
        out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(out, torch.tensor([local], dtype=torch.float64, device=device), group=group)
        self._samples, self._seconds = 0, 0.0
        return [float(t.item()) for t in out]

    def rebalance(self, step: int, per_sample_s: list[float]) -> bool:
        """Apply a new split if it is faster by more than the hysteresis; returns whether it changed."""
        known = [x for x in per_sample_s if math.isfinite(x) and x > 0]
        if not known:
            return False
        fill = sum(known) / len(known)  # a rank without a measurement is assumed average
        per = [x if (math.isfinite(x) and x > 0) else fill for x in per_sample_s]
        if self.per_sample_s is not None and len(self.per_sample_s) == len(per):
            # An exponential average over intervals: one noisy interval does not move samples.
            a = self.config.smoothing
            per = [a * new + (1 - a) * old for new, old in zip(per, self.per_sample_s)]
        self.per_sample_s = per
        min_share = min(self.config.min_share, sum(self.shares) // len(self.shares))
        new, t_old, t_new = rebalance(
            self.shares, [RankCost(per_sample=p) for p in per],
            min_share=min_share, max_share=self.config.max_share, hysteresis=self.config.hysteresis,
        )
        if new == self.shares:
            return False
        self.changes.append(SplitChange(step, list(self.shares), new, t_old, t_new))
        log.info("step %d: split %s -> %s (predicted compute per step %.1f ms -> %.1f ms)",
                 step, self.shares, new, 1e3 * t_old, 1e3 * t_new)
        self.shares = new
        return True

    def state_dict(self) -> dict:
        return {"shares": list(self.shares), "per_sample_s": list(self.per_sample_s or []),
                "samples": self._samples, "seconds": self._seconds, "steps_seen": self._steps_seen}

    def load_state_dict(self, state: dict) -> None:
        self.shares = [int(s) for s in state["shares"]]
        self.per_sample_s = [float(x) for x in state["per_sample_s"]] or None
        self._samples = int(state["samples"])
        self._seconds = float(state["seconds"])
        self._steps_seen = int(state["steps_seen"])

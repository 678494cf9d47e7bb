"""Re-split the global batch while the job runs, from every rank's measured speed.

Every ``interval`` steps each rank contributes its mean samples and compute seconds per step over
the interval; the ranks all-gather these. From the last few intervals, which ran at different
shares, each rank's cost is fitted as ``fixed + n * per_sample`` (a step has a fixed part: the
optimizer, kernel launches, Python), and every rank computes the same new split with the
planner's exact split function (identical inputs, pure functions: every rank agrees, DESIGN.md
invariant 4).
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


def fit_rank_cost(history: list[tuple[float, float]], min_spread: float = 1.1) -> RankCost | None:
    """A rank's step time as ``fixed + n * per_sample`` from (samples per step, seconds per step) pairs.

    Least squares over the intervals when they ran at shares that differ enough to tell the fixed
    part from the per-sample part; otherwise proportional to the newest interval.
    """
    points = [(n, t) for n, t in history if n > 0 and math.isfinite(t) and t > 0]
    if not points:
        return None
    ns = [n for n, _ in points]
    if len(points) >= 2 and max(ns) >= min_spread * min(ns):
        mean_n = sum(ns) / len(ns)
        mean_t = sum(t for _, t in points) / len(points)
        var = sum((n - mean_n) ** 2 for n in ns)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
        fixed = mean_t - slope * mean_n
        if slope > 0 and fixed >= 0:
            return RankCost(per_sample=slope, fixed=fixed)
        if slope > 0:  # a negative intercept is noise: no fixed part, the mean rate
            return RankCost(per_sample=mean_t / mean_n)
    n, t = points[-1]
    return RankCost(per_sample=t / n)


@dataclass
class Balancer:
    """Collects (samples, seconds) per step and re-splits every ``config.interval`` steps."""

    config: BalancePlan
    shares: list[int]
    warmup_steps: int = 1
    _samples: int = 0
    _seconds: float = 0.0
    _steps: int = 0
    _steps_seen: int = 0
    history: list[list[tuple[float, float]]] = field(default_factory=list)  # per rank, per interval
    costs: list[RankCost] | None = None        # the last fitted model of every rank
    changes: list[SplitChange] = field(default_factory=list)

    def record(self, samples: int, seconds: float) -> None:
        """One step of this rank: how many samples it computed, in how many compute seconds."""
        self._steps_seen += 1
        if self._steps_seen <= self.warmup_steps or samples <= 0:
            return  # the first steps pay for allocation and warm-up, not for samples
        self._samples += samples
        self._seconds += seconds
        self._steps += 1

    def due(self, step: int) -> bool:
        return self.config.enabled and step > 0 and step % self.config.interval == 0

    def exchange(self, device: torch.device, group=None) -> list[tuple[float, float]]:
        """All-gather every rank's (samples per step, compute seconds per step) of this interval."""
        local = [self._samples / self._steps, self._seconds / self._steps] if self._steps else [math.nan, math.nan]
        world = dist.get_world_size(group)
        out = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(out, torch.tensor(local, dtype=torch.float64, device=device), group=group)
        self._samples, self._seconds, self._steps = 0, 0.0, 0
        return [(float(t[0]), float(t[1])) for t in out]

    def rebalance(self, step: int, observed: list[tuple[float, float]]) -> bool:
        """Fit each rank's cost, apply the best split if faster by more than the hysteresis."""
        if len(self.history) != len(observed):
            self.history = [[] for _ in observed]
        for hist, point in zip(self.history, observed):
            if point[0] > 0 and math.isfinite(point[1]):
                hist.append(point)
                del hist[: -self.config.history]
        fitted = [fit_rank_cost(h) for h in self.history]
        known = [c for c in fitted if c is not None]
        if not known:
            return False
        # a rank without a measurement yet is assumed to cost what the average rank costs
        fill = RankCost(per_sample=sum(c.per_sample for c in known) / len(known),
                        fixed=sum(c.fixed for c in known) / len(known))
        costs = [c if c is not None else fill for c in fitted]
        self.costs = costs
        min_share = min(self.config.min_share, sum(self.shares) // len(self.shares))
        new, t_old, t_new = rebalance(self.shares, costs, min_share=min_share,
                                      max_share=self.config.max_share, hysteresis=self.config.hysteresis)
        if new == self.shares:
            return False
        self.changes.append(SplitChange(step, list(self.shares), new, t_old, t_new))
        log.info("step %d: split %s -> %s (predicted compute per step %.1f ms -> %.1f ms)",
                 step, self.shares, new, 1e3 * t_old, 1e3 * t_new)
        self.shares = new
        return True

    def state_dict(self) -> dict:
        return {"shares": list(self.shares),
                "history": [[list(p) for p in h] for h in self.history],
                "samples": self._samples, "seconds": self._seconds, "steps": self._steps,
                "steps_seen": self._steps_seen}

    def load_state_dict(self, state: dict) -> None:
        self.shares = [int(s) for s in state["shares"]]
        self.history = [[(float(n), float(t)) for n, t in h] for h in state["history"]]
        self._samples = int(state["samples"])
        self._seconds = float(state["seconds"])
        self._steps = int(state["steps"])
        self._steps_seen = int(state["steps_seen"])

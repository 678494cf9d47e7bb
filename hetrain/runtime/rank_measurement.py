"""What one rank measured for the balancer, as the ranks exchange it at a re-split.

Besides its step times at its share, two figures say what its step costs at 0 samples (``min_share`` 0),
where a rank still runs its step's fixed part: its optimizer step on its replica, the backward of exact
zeros that joins every gradient all-reduce. ``optimizer_seconds``, the median of its optimizer step's
seconds over its last steps (the same at any share), is the least a step of that rank takes at any share:
the intercept of its cost line where no slope is fitted (hetrain.runtime.cost_line), and its time at 0
samples until it has run some; ``idle_seconds``, the median of its steps at 0 samples, is what they took."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MEDIAN_SE = 1.2533      # standard error of a median of k normal draws: 1.2533 * sd / sqrt(k)
MIN_SCATTER = 0.01      # the least step-to-step scatter assumed, as a fraction of the median


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured, as exchanged at a re-split (NaN where it has no figure).

    ``samples``/``seconds``: its share and median compute seconds per step over the interval;
    ``window_*``: the same over its steps since the split last changed, with their scatter
    (a robust standard deviation) and how many steps there were; ``optimizer_seconds``: the median of its
    last steps' optimizer seconds; ``idle_seconds``: the median of its steps at 0 samples since the split
    last changed.
    """

    samples: float
    seconds: float
    window_samples: float
    window_seconds: float
    window_sd: float = 0.0
    window_steps: float = math.inf
    optimizer_seconds: float = math.nan
    idle_seconds: float = math.nan

    @classmethod
    def exact(cls, samples: float, seconds: float) -> "RankMeasurement":
        """A noise-free figure (planning, tests): one interval, and a window of the same."""
        return cls(samples, seconds, samples, seconds)

    def has_interval(self) -> bool:
        return self.samples > 0 and math.isfinite(self.seconds) and self.seconds > 0

    def has_window(self) -> bool:
        return self.window_samples > 0 and math.isfinite(self.window_seconds) and self.window_seconds > 0

    def has_idle(self) -> bool:
        return math.isfinite(self.idle_seconds) and self.idle_seconds > 0

    def floor(self) -> float:
        """The least a step of the rank takes at any share, its optimizer step's (0 where not timed)."""
        return self.optimizer_seconds if math.isfinite(self.optimizer_seconds) and self.optimizer_seconds > 0 else 0.0

    def standard_error(self) -> float:
        if not self.has_window() or not math.isfinite(self.window_sd):
            return math.inf
        if math.isinf(self.window_steps):
            return 0.0
        return MEDIAN_SE * self.window_sd / math.sqrt(max(self.window_steps, 1.0))


def spread(times: Sequence[float]) -> tuple[float, int]:
    """(sum of squared relative deviations from the mean, degrees of freedom) of one window's step
    times. A deviation counts at most 50%: a step stalled by outside load widens the scatter, as it
    should, without swamping it."""
    if len(times) < 2:
        return 0.0, 0
    mean = sum(times) / len(times)
    return sum(min(abs(t / mean - 1.0), 0.5) ** 2 for t in times), len(times) - 1


def median_or_nan(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan

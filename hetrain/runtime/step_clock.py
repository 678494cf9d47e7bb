"""Where a rank's wall time between two step ends goes, beside the compute the timer measures.

A step's wall time runs from the previous `step()`'s end to this one's. Besides compute and the
wait for data, it holds the script's own time (from `step()` returning to the next forward, between
the step's micro-batches and from its last backward to `step()`, less the data wait and the session's
collective calls there: logging, evaluation) and a checkpoint save
the previous `step()` made (its blocking part); what is left is waiting on the other ranks
(`StepRecord.waiting_seconds`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimes:
    wall: float | None        # None for a process's first step
    script: float
    checkpoint: float


class StepClock:
    """The wall-time bookkeeping of `session.step()`; keeps the last `history` steps' times."""

    def __init__(self, history: int) -> None:
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=history)
        self.compute_seconds: collections.deque[float] = collections.deque(maxlen=history)
        self._last_end: float | None = None
        self._returned: float | None = None   # when step() last returned
        self._held = 0.0                       # seconds the last step()'s checkpoint save held the loop

    def step_ended(self, first_forward: float | None, compute: float, data_wait: float,
                   between: float = 0.0) -> StepTimes:
        """The step's optimizer has run: its wall time since the last step's end, and its parts. `between`:
        the loop body's time between the step's micro-batches and before its step() (StepTimer.between_s)."""
        now = time.perf_counter()
        wall = now - self._last_end if self._last_end is not None else None
        if wall is not None:
            self.step_seconds.append(wall)
            self.compute_seconds.append(compute)
        self._last_end = now
        script = (max(0.0, first_forward - self._returned + between - data_wait)
                  if first_forward is not None and self._returned is not None else 0.0)
        times = StepTimes(wall, script, self._held if wall is not None else 0.0)
        self._held = 0.0
        return times

    @contextmanager
    def checkpoint(self) -> Iterator[None]:
        """A checkpoint save holds the loop: its time falls in the next step's wall time, as its own part."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._held = time.perf_counter() - start

    def returned(self) -> None:
        """step() returns: from here to the next forward, the script's own time."""
        self._returned = time.perf_counter()

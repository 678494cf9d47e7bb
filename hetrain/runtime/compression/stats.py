"""Bytes each rank sends and how much of that communication hides under backward.

Bytes are counted as a ring sends them, per rank: an all-reduce of P bytes sends 2(n-1)/n * P,
an all-gather or reduce-scatter (or all-to-all) whose whole gathered size is G sends (n-1)/n * G.

Overlap: a step's communication is outstanding from the moment a bucket's hook is called to the
moment its future completes. The last bucket's hook is called when backward has computed the last
gradient, so the outstanding time before that moment ran under backward (hidden) and the rest
was waited for (exposed). hidden_fraction = hidden seconds / outstanding seconds (union of the
intervals of a step, summed over steps).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


def allreduce_bytes(payload_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes``."""
    return 2.0 * (n - 1) / n * payload_bytes


def allgather_bytes(gathered_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) whose whole size is ``gathered_bytes``."""
    return (n - 1) / n * gathered_bytes


@dataclass
class CommStats:
    """Per-rank communication figures of one comm hook, cumulative over steps."""

    bytes_sent: float = 0.0
    steps: int = 0
    bytes_by_level: dict[str, float] = field(default_factory=dict)
    comm_seconds: float = 0.0
    hidden_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _intervals: list[list[float]] = field(default_factory=list, repr=False, compare=False)

    def add(self, nbytes: float, level: str = "flat") -> None:
        """Count ``nbytes`` sent by this rank (thread-safe: collectives may launch from callbacks)."""
        with self._lock:
            self.bytes_sent += nbytes
            self.bytes_by_level[level] = self.bytes_by_level.get(level, 0.0) + nbytes

    def take_step_bytes(self) -> dict[str, float]:
        """Bytes sent per level since the last call (for per-step reports)."""
        with self._lock:
            taken = getattr(self, "_reported", {})
            delta = {k: v - taken.get(k, 0.0) for k, v in self.bytes_by_level.items()}
            self._reported = dict(self.bytes_by_level)
        return {k: v for k, v in delta.items() if v}

    def bytes_per_step(self) -> float:
        """Mean bytes this rank sent per step (0 before the first step)."""
        return self.bytes_sent / self.steps if self.steps else 0.0

    def launched(self, is_last: bool) -> list[float]:
        """Record a bucket's launch now; returns the interval to pass to ``completed``."""
        now = time.perf_counter()
        with self._lock:
            if self._intervals and self._intervals[0][2] is not None and self._all_done():
                self._close_step()
            interval = [now, None, None]  # launch, done, end of backward (set on the last bucket)
            self._intervals.append(interval)
            if is_last:
                self.steps += 1
                for iv in self._intervals:
                    iv[2] = now
        return interval

    def completed(self, interval: list[float]) -> None:
        """Record that the bucket launched as ``interval`` finished communicating."""
        interval[1] = time.perf_counter()

    def hidden_fraction(self) -> float:
        """Share of outstanding communication time that ran before backward ended (1 = fully hidden)."""
        with self._lock:
            if self._intervals and self._intervals[0][2] is not None and self._all_done():
                self._close_step()
            return self.hidden_seconds / self.comm_seconds if self.comm_seconds > 0 else 0.0

    def _all_done(self) -> bool:
        return all(iv[1] is not None for iv in self._intervals)

    def _close_step(self) -> None:
        end_backward = self._intervals[0][2]
        spans = sorted((iv[0], iv[1]) for iv in self._intervals)
        merged: list[list[float]] = []
        for start, stop in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        for start, stop in merged:
            self.comm_seconds += stop - start
            self.hidden_seconds += max(0.0, min(stop, end_backward) - start)
        self._intervals = []

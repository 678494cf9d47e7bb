"""A pipeline rank's compute seconds: each chunk's forward and backward as torch's stage runs them (the hand-offs
between stages are outside them), less the seconds in FSDP2's collectives inside them where the stage is sharded
over its replicas (`hetrain.runtime.fsdp_waits`): waiting for the other replicas' shards is not compute, as under
data-parallel FSDP2. An emulated speed pads the compute alone: between two collectives where the stage is sharded
(a slow replica is slow in every block, and the others wait for it in the next gather), else the whole chunk."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hetrain.runtime.timing import pad_to_speed

if TYPE_CHECKING:   # FSDP2's collectives are imported where a stage is sharded, not with every session
    from hetrain.runtime.fsdp_waits import CommWaits


class StageClock:
    """This step's compute seconds of a rank's stages (padded when emulating a speed)."""

    def __init__(self, speed: float | None = None, comm_waits: CommWaits | None = None) -> None:
        self.speed = speed
        self.comm_waits = comm_waits   # FSDP2's collectives of a sharded stage, timed (None: none, or not timed)
        self.busy_seconds = 0.0

    def timed(self, work: Callable) -> Callable:
        """`work` (one chunk's forward or backward of a micro-batch), its compute added to the step's."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            waits = self.comm_waits
            started = time.perf_counter()
            if waits is None:
                out = work(*args, **kwargs)
                self.busy_seconds += pad_to_speed(time.perf_counter() - started, self.speed)
                return out
            waits.mark()   # pads each stretch of compute before the next collective, then the last at finish()
            try:
                return work(*args, **kwargs)
            finally:
                waits.finish()
                self.busy_seconds += max(0.0, time.perf_counter() - started - waits.since_mark())

        return timed

    def take(self) -> float:
        """This step's compute seconds so far, and start counting the next step's."""
        busy, self.busy_seconds = self.busy_seconds, 0.0
        return busy

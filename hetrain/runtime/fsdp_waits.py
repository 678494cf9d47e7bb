"""The seconds a rank spends in FSDP2's own collectives, so they are not counted as its compute.

Under FSDP2 every block's forward begins with an all-gather of its weights and every block's backward
ends with a reduce-scatter of its gradients; in each, a faster rank waits for a slower one. The step's
compute is timed from the first forward to the end of backward, so without this the faster rank's
waits counted as its compute, and the balancer, which splits by compute per sample, moved samples
toward the ranks already holding more. FSDP2 lets a model take its own all-gather and reduce-scatter
(`FSDPModule.set_custom_all_gather`, `set_custom_reduce_scatter`): these are torch's defaults, timed,
with the wait on an asynchronous gather's work timed too.

Where the process group does not block the calling thread (NCCL: its collectives run on their own
CUDA streams), the timed seconds are those of issuing them, near zero, and compute is timed as before.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

try:   # the classes FSDP2's custom collectives extend (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:   # pragma: no cover - an older torch: FSDP2's waits stay inside compute
    DefaultAllGather = DefaultReduceScatter = None


class CommWaits:
    """Seconds spent inside FSDP2's collectives since the last `mark()`."""

    def __init__(self) -> None:
        self.total = 0.0
        self._marked = 0.0

    def add(self, seconds: float) -> None:
        self.total += seconds

    def mark(self) -> None:
        self._marked = self.total

    def since_mark(self) -> float:
        return self.total - self._marked


class _TimedWork(dist.Work):
    """An asynchronous collective's work whose `wait()` is timed."""

    def __init__(self, inner: dist.Work, waits: CommWaits) -> None:
        super().__init__()
        self._inner, self._waits = inner, waits

    def wait(self, timeout: Any = None) -> bool:
        started = time.perf_counter()
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        finally:
            self._waits.add(time.perf_counter() - started)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future()


def _timed(call: Any, waits: CommWaits) -> Any:
    started = time.perf_counter()
    try:
        work = call()
    finally:
        waits.add(time.perf_counter() - started)
    return _TimedWork(work, waits) if isinstance(work, dist.Work) else work


if DefaultAllGather is not None:
    class TimedAllGather(DefaultAllGather):
        """FSDP2's default all-gather, its seconds (the call and the wait on its work) added to `waits`."""

        def __init__(self, waits: CommWaits) -> None:
            super().__init__()
            self.waits = waits

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _timed(lambda: super(TimedAllGather, self).__call__(*args, **kwargs), self.waits)

    class TimedReduceScatter(DefaultReduceScatter):
        """FSDP2's default reduce-scatter, its seconds added to `waits`."""

        def __init__(self, waits: CommWaits) -> None:
            super().__init__()
            self.waits = waits

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _timed(lambda: super(TimedReduceScatter, self).__call__(*args, **kwargs), self.waits)


def time_fsdp_collectives(model: torch.nn.Module) -> CommWaits | None:
    """Give every FSDP2 module in `model` the timed collectives; the seconds they take, or None where this
    torch has no custom collectives (compute then holds FSDP2's waits, as before)."""
    if DefaultAllGather is None:
        return None
    modules = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")
               and hasattr(m, "set_custom_reduce_scatter")]
    if not modules:
        return None
    waits = CommWaits()
    gather, scatter = TimedAllGather(waits), TimedReduceScatter(waits)
    for module in modules:
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    return waits

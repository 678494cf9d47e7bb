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

from hetrain.runtime.timing import pad_to_speed

try:   # the classes FSDP2's custom collectives extend
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:   # pragma: no cover - an older torch: FSDP2's waits stay inside compute
    DefaultAllGather = DefaultReduceScatter = None


class CommWaits:
    """Seconds spent inside FSDP2's collectives since the last `mark()` (the step's compute began). With an
    emulated `speed`, each stretch of compute between two collectives is padded to 1/speed of its time before
    the next one: an emulated slow rank is slow in every block, where the others wait for it, as a slow device
    is (padded after backward, its whole step's padding came where the others waited in one collective, and
    a split could not shorten the step)."""

    def __init__(self, speed: float | None = None) -> None:
        self.total = 0.0
        self.speed = speed
        self._marked = 0.0
        self._since: float | None = None   # the end of the last collective, while the step's compute runs

    def mark(self) -> None:
        """The step's compute begins."""
        self._marked = self.total
        self._since = time.perf_counter()

    def since_mark(self) -> float:
        return self.total - self._marked

    def finish(self) -> None:
        """The step's compute ends: its last stretch padded, none until the next mark."""
        self._pad()
        self._since = None

    def around(self, call: Any) -> Any:
        """`call()` (a collective, or the wait on one), its seconds counted; the compute before it padded."""
        self._pad()
        started = time.perf_counter()
        try:
            return call()
        finally:
            now = time.perf_counter()
            self.total += now - started
            if self._since is not None:
                self._since = now

    def _pad(self) -> None:
        if self._since is not None and self.speed is not None:
            pad_to_speed(time.perf_counter() - self._since, self.speed)


class _TimedWork(dist.Work):
    """An asynchronous collective's work whose `wait()` is timed."""

    def __init__(self, inner: dist.Work, waits: CommWaits) -> None:
        super().__init__()
        self._inner, self._waits = inner, waits

    def wait(self, timeout: Any = None) -> bool:
        return self._waits.around(lambda: self._inner.wait() if timeout is None else self._inner.wait(timeout))

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future()


def _timed(call: Any, waits: CommWaits) -> Any:
    work = waits.around(call)
    return _TimedWork(work, waits) if isinstance(work, dist.Work) else work


class _Timed:
    """Mixed before one of FSDP2's default collectives: its seconds (the call, and the wait on its work) go to
    `waits`."""

    def __init__(self, waits: CommWaits) -> None:
        super().__init__()
        self.waits = waits

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = super().__call__   # the default collective's
        return _timed(lambda: call(*args, **kwargs), self.waits)


if DefaultAllGather is not None:
    class TimedAllGather(_Timed, DefaultAllGather):
        """FSDP2's default all-gather, timed."""

    class TimedReduceScatter(_Timed, DefaultReduceScatter):
        """FSDP2's default reduce-scatter, timed."""


def time_fsdp_collectives(model: torch.nn.Module, speed: float | None = None) -> CommWaits | None:
    """Give every FSDP2 module in `model` the timed collectives; the seconds they take, or None where this
    torch has no custom collectives (compute then holds FSDP2's waits, as before). `speed`: the rank's
    emulated speed (CPU ranks), padded between collectives."""
    if DefaultAllGather is None:
        return None
    modules = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")
               and hasattr(m, "set_custom_reduce_scatter")]
    if not modules:
        return None
    waits = CommWaits(speed)
    gather, scatter = TimedAllGather(waits), TimedReduceScatter(waits)
    for module in modules:
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    return waits

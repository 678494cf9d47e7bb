"""DDP communication hooks chosen by the plan's CommPlan: none, fp16, bf16, powersgd, int8, topk.

``build_comm_hook(comm)`` returns ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.
Every hook returns the AVERAGE of the bucket over the ranks, like DDP's own all-reduce, so
gradients that were weighted by each rank's share stay the global-batch gradient (exactly for
``none``, to half precision for ``fp16``/``bf16``, with error feedback for the lossy ones).
torch's own hooks do the work where they exist (all-reduce, fp16/bf16, PowerSGD); int8 and top-k
live in ``hetrain.runtime.compression``; two-level all-reduce in ``hetrain.runtime.hierarchical``.

Each bucket's collectives run on one worker thread in DDP's bucket order (see
``compression/runner.py``), so backward keeps computing while gradients travel, and
``state.stats`` (a ``CommStats``) counts the bytes this rank sends and how much of the
communication time was hidden under backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from hetrain.errors import HetrainError
from hetrain.runtime.compression import (
    CommStats,
    Int8State,
    SerialRunner,
    TopkState,
    allreduce_bytes,
    int8_allreduce,
    topk_allreduce,
)

if TYPE_CHECKING:
    from hetrain.planning.plan import CommPlan

__all__ = [
    "CommStats", "FlatHookState", "build_comm_hook", "check_comm", "comm_hook", "ddp_kwargs", "flat_state",
    "forget_feedback", "powersgd_bytes",
]


def ddp_kwargs(comm: "CommPlan") -> dict[str, Any]:
    """DistributedDataParallel's overlap settings from the plan (bucket size, buckets as grad views)."""
    return {"bucket_cap_mb": comm.bucket_cap_mb, "gradient_as_bucket_view": comm.gradient_as_bucket_view}


@dataclass
class FlatHookState:
    """State of a one-level hook: the group, the compression's own state, counters, the worker."""

    compression: str
    process_group: dist.ProcessGroup | None
    inner: Any = None  # PowerSGDState | Int8State | TopkState | None
    stats: CommStats = field(default_factory=CommStats)
    runner: SerialRunner = field(default_factory=SerialRunner)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group if self.process_group is not None else dist.group.WORLD)

    def reduce(self, bucket: dist.GradBucket) -> torch.Tensor:
        """Average ``bucket`` over the group now (blocking); counts the bytes sent."""
        return _REDUCERS[self.compression](self, bucket)

    def forget_feedback(self) -> None:
        """Drop what the compression carries to the next step (residuals, PowerSGD's error and warm start)."""
        if isinstance(self.inner, PowerSGDState):
            for memory in (self.inner.error_dict, self.inner.p_memory_dict, self.inner.q_memory_dict):
                memory.clear()
        elif self.inner is not None:
            self.inner.forget()


def _allreduce(state: FlatHookState, bucket: dist.GradBucket) -> torch.Tensor:
    buf = bucket.buffer()
    state.stats.add(allreduce_bytes(buf.numel() * buf.element_size(), state.world_size))
    return default_hooks.allreduce_hook(state.process_group, bucket).wait()


def _cast_allreduce(dtype: torch.dtype, torch_hook: Callable) -> Callable:
    def reduce(state: FlatHookState, bucket: dist.GradBucket) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        state.stats.add(allreduce_bytes(bucket.buffer().numel() * itemsize, state.world_size))
        return torch_hook(state.process_group, bucket).wait()

    return reduce


def powersgd_bytes(ps: PowerSGDState, bucket: dist.GradBucket, n: int) -> tuple[float, int, int]:
    """(bytes, P elements, Q elements) torch's PowerSGD hook sends for ``bucket`` at its current iteration.

    During warm-up it all-reduces the whole bucket; after, it all-reduces the tensors not worth
    compressing (vectors, small matrices) as they are, and each matrix's P and Q.
    """
    buf = bucket.buffer()
    if ps.iter < ps.start_powerSGD_iter:
        return allreduce_bytes(buf.numel() * buf.element_size(), n), 0, 0
    plain = p_elems = q_elems = 0
    for grad in bucket.gradients():
        rows = grad.shape[0]
        cols = grad.numel() // rows
        rank = min(rows, cols, ps.matrix_approximation_rank)
        if (rows + cols) * rank * ps.min_compression_rate < rows * cols:
            p_elems += rows * rank
            q_elems += cols * rank
        else:
            plain += rows * cols
    return allreduce_bytes((plain + p_elems + q_elems) * buf.element_size(), n), p_elems, q_elems


def _powersgd(state: FlatHookState, bucket: dist.GradBucket) -> torch.Tensor:
    ps: PowerSGDState = state.inner
    nbytes, p_elems, q_elems = powersgd_bytes(ps, bucket, state.world_size)
    state.stats.add(nbytes)
    compressing = ps.iter >= ps.start_powerSGD_iter
    out = powerSGD_hook(ps, bucket).wait()
    if compressing:
        assert ps.p_memory_dict[bucket.index()].numel() == p_elems, "PowerSGD P size differs from the byte count"
        assert ps.q_memory_dict[bucket.index()].numel() == q_elems, "PowerSGD Q size differs from the byte count"
    return out


_REDUCERS: dict[str, Callable[[FlatHookState, dist.GradBucket], torch.Tensor]] = {
    "none": _allreduce,
    "fp16": _cast_allreduce(torch.float16, default_hooks.fp16_compress_hook),
    "bf16": _cast_allreduce(torch.bfloat16, default_hooks.bf16_compress_hook),
    "powersgd": _powersgd,
    "int8": lambda state, bucket: int8_allreduce(state.inner, bucket),
    "topk": lambda state, bucket: topk_allreduce(state.inner, bucket),
}


def comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """The DDP comm hook of every hetrain state: queue the bucket's reduction, time it, return its future."""
    interval = state.stats.launched(bucket.is_last())

    def job() -> torch.Tensor:
        out = state.reduce(bucket)
        state.stats.completed(interval)
        return out

    return state.runner.submit(job)


def forget_feedback(state: Any) -> None:
    """After a step skipped for non-finite gradients, on every rank: the compression's carried error holds
    part of that step's gradients, or their inf/NaN, which would reach later steps (and make every one of
    them non-finite); it starts again from zero. ``state`` is a hook state, or a timing state holding one."""
    inner = getattr(state, "inner_state", state)
    if hasattr(inner, "forget_feedback"):
        inner.forget_feedback()


# DDP checks the hook's annotations as objects; this module's annotations are strings.
comm_hook.__annotations__.update(bucket=dist.GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]})


def check_comm(comm: "CommPlan", powersgd_error_feedback: bool = True) -> None:
    """Raise HetrainError for a CommPlan the hooks cannot run (checked before any group is created)."""
    if comm.compression not in _REDUCERS:
        raise HetrainError(f"comm.compression={comm.compression!r} is unknown; use one of {sorted(_REDUCERS)}")
    if comm.compression == "powersgd" and powersgd_error_feedback and comm.powersgd_warmup_steps < 2:
        raise HetrainError(
            f"comm.powersgd_warmup_steps={comm.powersgd_warmup_steps}: PowerSGD with error feedback needs at "
            "least 2 uncompressed steps (DDP rebuilds its buckets after the first); set it to 2 or more"
        )


def flat_state(
    comm: "CommPlan", process_group: dist.ProcessGroup | None, powersgd_error_feedback: bool = True
) -> FlatHookState:
    """The one-level hook state for ``comm.compression`` over ``process_group`` (None = world)."""
    check_comm(comm, powersgd_error_feedback)
    stats = CommStats()
    inner: Any = None
    if comm.compression == "powersgd":
        inner = PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=comm.powersgd_rank,
            start_powerSGD_iter=comm.powersgd_warmup_steps,
            use_error_feedback=powersgd_error_feedback,
            warm_start=powersgd_error_feedback,
            random_seed=0,
        )
    elif comm.compression == "int8":
        inner = Int8State(process_group=process_group, stats=stats)
    elif comm.compression == "topk":
        inner = TopkState(process_group=process_group, stats=stats, ratio=comm.topk_ratio)
    return FlatHookState(comm.compression, process_group, inner, stats)


def build_comm_hook(
    comm: "CommPlan", process_group: dist.ProcessGroup | None = None, powersgd_error_feedback: bool = True
) -> tuple[object, Callable[[Any, dist.GradBucket], torch.futures.Future]]:
    """(state, hook) for DistributedDataParallel.register_comm_hook from the plan's CommPlan.

    hook(state, bucket) returns the average over the ranks; state.stats counts bytes and overlap.
    With ``comm.hierarchical`` the ranks reduce inside their island first (every rank must call
    this, in the same order, since it creates the island process groups).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise HetrainError(
            "build_comm_hook needs torch.distributed: call dist.init_process_group (or start under "
            "hetrain launch / torchrun) before building the comm hook"
        )
    check_comm(comm, powersgd_error_feedback)
    if comm.hierarchical:
        from hetrain.runtime.hierarchical import hierarchical_state

        return hierarchical_state(comm, process_group, powersgd_error_feedback), comm_hook
    return flat_state(comm, process_group, powersgd_error_feedback), comm_hook

"""A model's buffers across ranks: rank 0's copy on every rank after each step's last backward (the first
rank with samples, where rank 0 had none in the step).

BatchNorm's running statistics, and any buffer a forward writes (a counter, an average kept in the
model), move on each rank with that rank's own share of the batch. DDP copies rank 0's buffers to
every rank at the start of a step's first training forward, and FSDP2 copies none, so between steps the
ranks held different models: an EMA of the model (`AveragedModel` copies buffers) differed between
ranks, a validation loss was each rank's own model's, and under FSDP2 a checkpoint kept one arbitrary
rank's copy. hetrain copies rank 0's buffers to every rank once a step, after the last backward
(one broadcast per dtype, DDP's own copy turned off), under every data-parallel plan: DDP's update
exactly, micro-batches or not (the same buffers start each step), and every rank holds, between steps,
the model a checkpoint saves and `session.model_state_dict()` returns.

A forward of a piece without samples (a rank whose share of the step is 0, a stand-in piece that runs
so every rank issues the same collectives) leaves the buffers as it found them: BatchNorm's running
mean over no samples is NaN, which the copy would have sent to every rank. Nor is such a rank's copy the
one sent: where rank 0 had no samples, the copy comes from the first rank that had some.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.runtime.replicas import copy_from


Places = list[tuple[nn.Module, str, torch.Tensor]]


def buffer_places(module: nn.Module) -> Places:
    """Where the module's buffers are (module, name) and the tensor each held at prepare()."""
    return [(m, name, b) for m in module.modules() for name, b in m.named_buffers(recurse=False)]


def sync_buffers(places: Places, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every rank's buffers (of `group`) with global rank `src`'s (collective; the step's first rank with
    samples; under a pipeline, a stage's replicas: the first replica's with samples). Each
    place's buffer now, where it has the size, dtype and device it had at prepare() (one a forward replaced,
    `self.m = 0.9 * self.m + ...`, is copied too), else the tensor it held then, as a stand-in of that size: a
    cache a forward regrew to its rank's longest sequence stays the rank's own, and every rank broadcasts the
    same sizes in the same order."""
    buffers = []
    for m, name, first in places:
        now = getattr(m, name, None)
        alike = isinstance(now, torch.Tensor) and now.shape == first.shape and now.dtype == first.dtype and \
            now.device == first.device
        buffers.append(now if alike else first)
    if buffers:
        copy_from(buffers, src=src, group=group)


Snapshot = list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]


def snapshot_buffers(module: nn.Module) -> Snapshot:
    """The module's buffers as they are now: each tensor by reference (a forward that puts a new one in a
    buffer's place leaves the old one here) and a copy of its values."""
    return [(m, name, b, b.detach().clone()) for m in module.modules() for name, b in m.named_buffers(recurse=False)]


def restore_buffers(snapshot: Snapshot) -> None:
    """Each buffer back as `snapshot_buffers` found it: its values copied into it (through .data: autograd's
    version counter stays, so the backward of the forward that ran is not refused as modified in place;
    BatchNorm's is given the running statistics, which training ignores), and the tensor itself back in its
    place where a forward put another there."""
    for m, name, b, copy in snapshot:
        b.data.copy_(copy)
        if getattr(m, name) is not b:
            setattr(m, name, b)


def keep_buffers_without_samples(module: nn.Module, without_samples: Callable[[], bool]) -> None:
    """Hooks on the model: a forward while `without_samples()` leaves its buffers as they were."""
    saved: list[Snapshot] = []

    def before(_module: nn.Module, _args: Any) -> None:
        saved[:] = [snapshot_buffers(module)] if without_samples() else []   # a forward that raised left none

    def after(_module: nn.Module, _args: Any, _output: Any) -> None:
        if saved:
            restore_buffers(saved.pop())

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)

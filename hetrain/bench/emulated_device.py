"""Emulated device compute for benchmarks on CPU ranks: a layer that takes the time an accelerator
would spend on its batch, without using the host's CPU.

On a GPU host the model's arithmetic runs on the device while the CPU cores decode and collate the
next batches. A CPU rank that does the arithmetic itself takes those cores from its input pipeline,
so a benchmark of input pipelines on CPU ranks would measure core contention, not the pipeline.
`DeviceTime` stands for the device: its forward waits ``ms_per_sample / 3`` per sample (over the
given speed), its backward twice that (the usual 1:2 ratio), and the wait is a sleep, which leaves
the cores to the workers as a GPU would. Every figure it shapes is labelled emulated.
"""

from __future__ import annotations

import torch
from torch import nn

from hetrain.runtime.timing import EMULATION_CLOCK   # the rank's one emulation clock


class _DeviceWait(torch.autograd.Function):
    """Identity that waits `seconds` in forward and twice that in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        EMULATION_CLOCK.wait(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        EMULATION_CLOCK.wait(2.0 * ctx.seconds)
        return grad, None


class DeviceTime(nn.Module):
    """The device's compute for a batch: ``ms_per_sample`` (forward and backward) at speed 1, over
    ``speed``. Place it after the model's last layer, so its backward wait comes before any gradient
    is ready, as a device's backward would."""

    def __init__(self, ms_per_sample: float, speed: float = 1.0) -> None:
        super().__init__()
        if ms_per_sample < 0 or not speed > 0:
            raise ValueError(f"ms_per_sample must be >= 0 and speed > 0, got {ms_per_sample}, {speed}")
        self.seconds_per_sample = ms_per_sample / 3000.0 / speed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            EMULATION_CLOCK.wait(self.seconds_per_sample * x.shape[0])
            return x
        return _DeviceWait.apply(x, self.seconds_per_sample * x.shape[0])

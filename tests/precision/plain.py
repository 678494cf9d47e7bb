"""What one process would do with plain torch, for references that must not share hetrain's code: torch's
own autocast, and a dynamic loss scale with torch.amp.GradScaler's defaults written out by hand."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def plain_autocast(precision: str):
    """torch.autocast on CPU for a bf16/fp16 rank; nothing for fp32."""
    if precision in DTYPES:
        return torch.autocast("cpu", dtype=DTYPES[precision])
    return contextlib.nullcontext()


class PlainLossScale:
    """GradScaler's rule: start at 2**16, halve on an overflow, double after 2000 good steps; not below 1."""

    def __init__(self, enabled: bool) -> None:
        self.scale = 2.0**16 if enabled else 1.0
        self.enabled = enabled
        self.good = 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good = max(self.scale / 2, 1.0), 0
        else:
            self.good += 1
            if self.good % 2000 == 0:
                self.scale *= 2

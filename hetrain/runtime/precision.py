"""Each rank in its own precision, one loss scale for the whole job.

Master weights and optimizer state stay fp32; `autocast()` enters the rank's autocast. When any
rank of the job computes in fp16, every rank multiplies its loss by the same job-wide scale, so
DDP averages gradients that are all at one scale; after the average, gradients are divided by the
scale. Whether the step overflowed is all-reduced (MAX), so every rank skips the same steps and
moves the scale identically (DESIGN.md invariants 1 and 4). Ranks in bf16 or fp32 need no scale of
their own; they share the job's so that the average stays correct.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class JobLossScaler:
    """A dynamic loss scale shared by every rank: same value, same skips, same growth."""

    def __init__(self, enabled: bool, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, group=None,
                 device: torch.device | str = "cpu") -> None:
        self.enabled = enabled
        self.device = torch.device(device)
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.group = group
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide the averaged gradients by the scale; True when every rank's are finite."""
        if not self.enabled:
            return True
        # Sharded (FSDP2) gradients: each rank unscales and checks its own shard; the MAX below joins them.
        grads = [_local(p.grad) for p in params if p.grad is not None]
        inv = 1.0 / self.scale
        local_bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else self.device)
        if grads:
            torch._foreach_mul_(grads, inv)
            bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
            local_bad = torch.maximum(local_bad, bad.float().reshape(1))
        dist.all_reduce(local_bad, op=dist.ReduceOp.MAX, group=self.group)
        return bool(local_bad.item() == 0.0)

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
        else:
            self.skipped_steps += 1
            self.good_steps = 0
            self.scale *= self.backoff_factor

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """The rank's autocast region: bf16/fp16 autocast, or nothing for fp32/tf32."""
    dtype = _DTYPES.get(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def configure_tf32(precision: str, device: torch.device) -> None:
    """TF32 matmuls where the chip has them and the plan allows (tf32, bf16, fp16 ranks)."""
    if device.type == "cuda":
        allow = precision != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow

"""Model FLOPs utilisation: the model's FLOPs per second over the device's datasheet peak in its precision."""

from __future__ import annotations

from hetrain.errors import HetrainError
from hetrain.hardware.catalog import get_gpu


def catalog_peak_flops(device_name: str, precision: str) -> float | None:
    """The catalog's dense peak FLOP/s of `device_name` in `precision`; None when unknown or unsupported,
    and for a CPU: its catalog figure is the planner's estimate of what a loop reaches on the host's
    cores, not a peak of one rank (a rank's threads exceeded it: an MFU of 230%)."""
    try:
        spec = get_gpu(device_name)
    except HetrainError:
        return None
    return None if spec.arch == "cpu" else (spec.peak_flops.get(precision, 0.0) or None)


def mfu(flops_per_item: float | None, items: int, seconds: float | None, peak_flops: float | None) -> float | None:
    """FLOPs of `items` done in `seconds`, as a fraction of `peak_flops`: 0 for a step that computed none (a rank
    at 0 samples still spends the step's time); None when a figure is missing (no peak, no FLOPs model, no time)."""
    if flops_per_item is None or not peak_flops or not seconds or seconds <= 0:
        return None
    return flops_per_item * items / seconds / peak_flops

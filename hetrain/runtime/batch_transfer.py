"""Batches moved to the rank's device: tensors inside dicts, mappings (a BatchEncoding), lists, tuples,
named tuples and dataclasses (hetrain.runtime.batch_tree walks them).

On CUDA the host tensors are pinned first and copied without blocking, so the copy overlaps the
work already queued on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from hetrain.runtime.batch_tree import map_leaves


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor on `device` (the same structure and types otherwise)."""
    device = torch.device(device)
    cuda = device.type == "cuda"

    def move(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device == device:
                return obj
            if cuda and obj.device.type == "cpu":
                return (obj if obj.is_pinned() else obj.pin_memory()).to(device, non_blocking=True)
            return obj.to(device)
        mover = getattr(obj, "to", None)  # other batch objects with their own .to(device)
        if callable(mover) and not isinstance(obj, (str, bytes)):
            return mover(device)
        return obj

    return map_leaves(move, batch)

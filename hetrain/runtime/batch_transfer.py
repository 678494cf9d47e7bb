"""Batches moved to the rank's device: tensors inside dicts, lists, tuples, named tuples and dataclasses.

On CUDA the host tensors are pinned first and copied without blocking, so the copy overlaps the
work already queued on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


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
        if isinstance(obj, dict):
            return type(obj)((k, move(v)) for k, v in obj.items()) if type(obj) is not dict else \
                {k: move(v) for k, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*(move(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(move(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {f.name: move(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            return dataclasses.replace(obj, **changes)
        mover = getattr(obj, "to", None)  # batch objects with their own .to(device), e.g. BatchEncoding
        if callable(mover) and not isinstance(obj, (str, bytes)):
            return mover(device)
        return obj

    return move(batch)

"""The batches `hetrain profile` feeds a model: a tensor, a tuple or list of them (positional inputs),
or a dict of them (keyword inputs, called as model(**batch), as hetrain's runtime does), batch first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetrain.errors import HetrainError


def batch_tensors(batch: Any) -> list:
    """The top-level inputs of a batch, in the order the model receives them."""
    if isinstance(batch, Mapping):
        return list(batch.values())
    if isinstance(batch, (tuple, list)):
        return list(batch)
    return [batch]


def batch_rows(batch: Any, what: str = "sample_input") -> int:
    """Samples in a batch: the leading dimension of its first tensor, or of every tensor of a dict
    (keyword inputs, which must agree, but for tensors of one row that every sample shares, such as
    `position_ids` of shape [1, T], as the runtime gives them whole to every micro-batch)."""
    import torch

    values = batch_tensors(batch)
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0]
    if isinstance(batch, Mapping):
        rows = sorted({int(t.shape[0]) for t in tensors} - {1}) or [1]
        if len(rows) > 1:
            sizes = ", ".join(f"{k}: {int(v.shape[0])}" for k, v in batch.items()
                              if isinstance(v, torch.Tensor) and v.dim() > 0)
            raise HetrainError(f"{what} is a dict whose tensors have different first dimensions ({sizes}); give "
                               "each keyword input the batch's samples first (or one row every sample shares)")
        if tensors:
            return rows[0]
    elif values and not (isinstance(values[0], torch.Tensor) and values[0].dim() > 0):
        tensors = []
    if not tensors:
        raise HetrainError(f"{what} must be a batched tensor, a tuple of them or a dict of them (keyword inputs), "
                           "with the batch first")
    return int(tensors[0].shape[0])


def to_device(batch: Any, device) -> Any:
    """The batch with its tensors on `device`, inside nested dicts, lists and tuples too (anything else as
    it is): the runtime moves a nested batch so, and a block timed on a tensor left on the CPU would fail."""
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):   # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch.to(device) if hasattr(batch, "to") else batch


def batch_signature(batch: Any) -> list[str]:
    """Every tensor of a batch, nested ones too, as 'path: dtype[shape of one sample]' (the leading
    dimension left out), sorted: what a model's identity takes of its inputs, whatever a dict's key order."""
    import torch

    out: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            shape = ", ".join(str(d) for d in value.shape[1:])
            out.append(f"{path or 'input'}: {str(value.dtype).removeprefix('torch.')}[{shape}]")
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    walk(batch, "")
    return sorted(out)


def call_model(module, batch: Any):
    """module(**batch) for a dict, module(*batch) for a tuple or list, module(batch) otherwise."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)

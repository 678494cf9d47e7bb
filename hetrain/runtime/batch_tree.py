"""The values of a batch, wherever a collate function put them.

A batch is walked through dicts (their subclasses too, keeping their type and attributes), mappings
like Hugging Face's `BatchEncoding` (a `UserDict`, what tokenizers and their collators return),
named tuples, lists, tuples and dataclasses; anything else is a leaf. torch's own tree functions
treat a `UserDict` as one opaque leaf, so a `BatchEncoding` would be neither cut into micro-batches
nor emptied for a rank without samples.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hetrain.errors import HetrainError


def map_leaves(fn: Callable[[Any], Any], batch: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """The batch with every leaf replaced by fn(leaf); containers keep their types. `is_leaf` may make a
    container a leaf (a list of one value per sample)."""
    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) or (is_leaf is not None and is_leaf(obj)):
            return fn(obj)
        if obj is None:   # structure, not a value (as torch's trees have it)
            return None
        if isinstance(obj, UserDict):
            new = copy.copy(obj)
            new.data = {k: walk(v) for k, v in obj.data.items()}
            return new
        if isinstance(obj, dict):
            if type(obj) is dict:
                return {k: walk(v) for k, v in obj.items()}
            new = copy.copy(obj)   # keeps a subclass's own state (an OrderedDict's order, a defaultdict's factory)
            for k, v in obj.items():
                new[k] = walk(v)
            return new
        if isinstance(obj, Mapping):
            return type(obj)({k: walk(v) for k, v in obj.items()})
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # a named tuple
            return type(obj)(*(walk(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: walk(getattr(obj, f.name))
                                               for f in dataclasses.fields(obj) if f.init})
        return fn(obj)

    return walk(batch)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """The batch with every tensor replaced by fn(tensor); all else as it was."""
    return map_leaves(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, batch)


PLAIN = (str, bytes, int, float, bool, type(None))


def per_sample_values(obj: Any, samples: int) -> bool:
    """Whether `obj` is a list or tuple of one plain value (a string, a number) per sample, as torch's
    default_collate leaves strings and `zip(*batch)` leaves anything: a field to cut with the samples."""
    return (isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields") and samples > 0 and len(obj) == samples
            and all(isinstance(v, PLAIN) for v in obj))


def flatten(batch: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """(the batch's leaves in a fixed order, a function that builds the batch with other leaves)."""
    leaves: list[Any] = []
    map_leaves(lambda x: leaves.append(x) or x, batch)

    def rebuild(new: list[Any]) -> Any:
        it = iter(new)
        return map_leaves(lambda _: next(it), batch)

    return leaves, rebuild


def tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in the batch, in `flatten`'s order."""
    return [x for x in flatten(batch)[0] if isinstance(x, torch.Tensor)]


def is_array(x: Any) -> bool:
    """A NumPy array (or any array with a tuple shape and a dtype) that is not a tensor."""
    return isinstance(getattr(x, "shape", None), tuple) and hasattr(x, "dtype")


def plain_values(obj: Any) -> bool:
    """A plain value, or a list or tuple of them or of such lists (offsets as (start, end) pairs), at any
    depth (named tuples excluded)."""
    if isinstance(obj, PLAIN):
        return True
    return isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields") and all(plain_values(v) for v in obj)


def per_sample_lists(obj: Any, samples: int) -> bool:
    """Whether `obj` is a list or tuple of one list of plain values per sample (token ids of their own
    lengths, a tokenizer's unpadded offsets as lists of pairs): a field to cut with the samples."""
    return (isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields") and samples > 0 and len(obj) == samples
            and all(not isinstance(v, PLAIN) and plain_values(v) for v in obj))


def per_sample_items(obj: Any, samples: int) -> bool:
    """Whether `obj` is a list or tuple of one tensor or dict per sample (what a detection collate's
    `tuple(zip(*batch))` leaves): all dicts, or all tensors of which some do not have the samples as their
    first dimension (the batch's fields all would; images of as many channels as samples cannot be told
    from them)."""
    if not isinstance(obj, (list, tuple)) or hasattr(obj, "_fields") or samples < 1 or len(obj) != samples:
        return False
    if all(isinstance(v, Mapping) for v in obj):
        return True
    return all(isinstance(v, torch.Tensor) for v in obj) and any(v.dim() == 0 or v.shape[0] != samples for v in obj)


def sample_leaves(batch: Any, samples: int) -> Callable[[Any], bool]:
    """Which containers of `batch` `cut_leaf` takes whole: a list of one plain value per sample anywhere (a
    dataset of strings collates to one), a list of one list of plain values, tensor or dict per sample below
    the top level (the top level holds fields, `(inputs, labels)`, whatever their number)."""
    return lambda x: per_sample_values(x, samples) or (
        x is not batch and (per_sample_lists(x, samples) or per_sample_items(x, samples)))


def cut_leaf(x: Any, start: int, stop: int, samples: int) -> Any:
    """Samples [start, stop) of a batch's leaf that is not a tensor, the batch holding `samples`: a list of
    one value (or one list of values) per sample or an array whose first dimension is the samples is cut; a plain value (a count,
    a name) belongs to the whole batch and is kept; anything else cannot be cut and is refused."""
    if per_sample_values(x, samples) or per_sample_lists(x, samples):
        return type(x)(x[start:stop])
    if per_sample_items(x, samples):
        raise HetrainError(
            f"the batch holds a {type(x).__name__} of one {type(x[0]).__name__} per sample (a detection-style "
            "collate), which hetrain does not cut into micro-batches or empty for a rank without samples: "
            "collate the samples into batch tensors (padding them), or plan no micro-batches and keep "
            "drop_last=True")
    if is_array(x):
        return x[start:stop] if x.shape and x.shape[0] == samples else x
    if isinstance(x, PLAIN):
        return x
    raise HetrainError(
        f"the batch holds a {type(x).__name__} object, which hetrain cannot cut into a rank's samples (a rank "
        "given fewer samples of a step, or none at the end of an epoch; micro-batches): have the collate_fn "
        "return tensors, or lists of one value per sample, in a dict, tuple, list, named tuple or dataclass")


def check_cuttable(batch: Any, samples: int) -> None:
    """Refuse, in one line, a batch holding a value `cut_leaf` cannot cut (before a step needs to)."""
    map_leaves(lambda x: x if isinstance(x, torch.Tensor) else cut_leaf(x, 0, samples, samples), batch,
               is_leaf=sample_leaves(batch, samples))

"""A pipeline replica's batch, gathered from the slices its ranks' loaders read.

The loader spreads a replica's share over all its ranks; the first stage needs the inputs and the
last the targets, so the replica's ranks all-gather their slices, in rank order. A batch of tensors
(the usual `(inputs, labels)`) travels as one byte buffer per rank after a small header, so no
tensor is pickled; anything else (or ranks whose batches differ in structure) goes through
`all_gather_object`. Every rank takes the same path: it is decided from the gathered headers.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.batch_tree import flatten, map_tensors, tensors


def _layout(leaves: list[Any]) -> tuple[int, int, int] | None:
    """(samples, bytes per sample, signature of dtypes and shapes) of a batch of tensors sharing their
    first dimension, or None."""
    if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
        return None
    n = leaves[0].shape[0]
    if any(t.shape[0] != n for t in leaves):
        return None
    per_sample = sum(math.prod(t.shape[1:]) * t.element_size() for t in leaves)
    signature = zlib.crc32(repr([(str(t.dtype), tuple(t.shape[1:])) for t in leaves]).encode())
    return n, per_sample, signature


def gather_replica_batch(batch: Any, group: dist.ProcessGroup, device: torch.device) -> Any:
    """The replica's batch on `device`: every rank's slice, in rank order (this rank's own when no
    rank holds samples)."""
    leaves, rebuild = flatten(batch)
    layout = _layout(leaves)
    header = torch.tensor(list(layout) + [1] if layout else [0, 0, 0, 0], dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(dist.get_world_size(group))]
    dist.all_gather(headers, header, group=group)
    rows = [h.tolist() for h in headers]
    if any(r[3] == 0 for r in rows) or len({(r[1], r[2]) for r in rows}) != 1:
        return _gather_objects(batch, group, device)
    counts, per_sample = [r[0] for r in rows], rows[0][1]
    if sum(counts) == 0:
        return batch
    widest = max(counts) * per_sample
    mine = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in leaves]) if layout[0] \
        else torch.empty(0, dtype=torch.uint8, device=device)
    padded = torch.zeros(widest, dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine.to(device)
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    joined = [[] for _ in leaves]
    for part, n in zip(parts, counts):
        offset = 0
        for i, t in enumerate(leaves):
            size = n * math.prod(t.shape[1:]) * t.element_size()
            # (a copy starts at offset 0, which viewing the bytes as a wider dtype needs)
            joined[i].append(part[offset:offset + size].clone().view(t.dtype).view(n, *t.shape[1:]))
            offset += size
    return rebuild([torch.cat(chunks) for chunks in joined])


def _gather_objects(batch: Any, group: dist.ProcessGroup, device: torch.device) -> Any:
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, _to(batch, torch.device("cpu")), group=group)
    parts = [p for p in parts if _samples(p) > 0]
    if not parts:
        return batch
    return _to(_concat(parts), device)


def _samples(value: Any) -> int:
    leaves = [t for t in tensors(value) if t.dim() > 0]
    return int(leaves[0].shape[0]) if leaves else 0


def _to(value: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), value)


def _concat(parts: list[Any]) -> Any:
    """The parts (batches of one structure) joined: each tensor concatenated along its first
    dimension, anything else taken from the first part."""
    leaves, rebuild = flatten(parts[0])
    columns = [flatten(p)[0] for p in parts]
    for i, leaf in enumerate(leaves):
        shapes = {tuple(c[i].shape[1:]) for c in columns if isinstance(c[i], torch.Tensor)}
        if len(shapes) > 1:
            seen = " and ".join(str(list(s)) for s in sorted(shapes))
            raise HetrainError(
                f"the ranks of a pipeline replica collated their slices of its batch to different shapes (per sample "
                f"{seen}): each rank collates its own slice, so padding to each batch's longest pads each slice to "
                "its own longest; pad to one length for the whole step (a fixed max_length, or batches bucketed by "
                "length) (docs/pipeline.md)")
    return rebuild([torch.cat([c[i] for c in columns]) if isinstance(leaf, torch.Tensor) else leaf
                    for i, leaf in enumerate(leaves)])

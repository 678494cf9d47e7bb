"""Every copy of a model starts as rank 0's: its parameters and buffers sent from rank 0.

DDP does this when it wraps a model, so a script that seeds each rank differently (or not at all)
still trains one model. FSDP2 and a pipeline's stages do not: FSDP2 would keep each rank's shard of
its own initialisation (a mix), and a stage's replicas, or the stages holding a tied weight, would
apply one summed gradient to different weights. hetrain copies rank 0's before sharding or training.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers, each once."""
    return list({id(t): t for t in itertools.chain(module.parameters(), module.buffers())}.values())


BUCKET_BYTES = 64 << 20   # at most this much copied at once: the copy costs no more memory than that


def _by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors in buckets of one dtype and at most BUCKET_BYTES (a larger tensor is a bucket alone),
    in the same order on every rank."""
    groups: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    filled: dict[torch.dtype, int] = {}   # bytes in each dtype's last bucket
    for t in tensors:
        buckets, nbytes = groups.setdefault(t.dtype, [[]]), t.numel() * t.element_size()
        if buckets[-1] and filled[t.dtype] + nbytes > BUCKET_BYTES:
            buckets.append([])
            filled[t.dtype] = 0
        buckets[-1].append(t)
        filled[t.dtype] = filled.get(t.dtype, 0) + nbytes
    return [b for buckets in groups.values() for b in buckets if b]


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype   # gloo carries no bool


def _flat(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket as one tensor on `device`: a lone contiguous tensor there is itself (written in place)."""
    if len(ts) == 1 and ts[0].is_contiguous() and ts[0].device == torch.device(device) and \
            _wire(ts[0].dtype) == ts[0].dtype:
        return ts[0].detach()
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=_wire(t.dtype)) for t in ts])


def _unflatten_into(ts: list[torch.Tensor], flat: torch.Tensor) -> None:
    if len(ts) == 1 and flat.data_ptr() == ts[0].data_ptr():
        return   # received in place
    with torch.no_grad():
        for t, part in zip(ts, torch.split(flat, [t.numel() for t in ts])):
            t.copy_(part.view(t.shape))


def _slices(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor larger than a bucket as flat slices of at most BUCKET_BYTES (views of a contiguous tensor)."""
    flat = t.detach().contiguous().view(-1)
    step = max(1, BUCKET_BYTES // max(1, t.element_size()))
    return list(flat.split(step))


def send_to(tensors: Iterable[torch.Tensor], dst: int, device: torch.device) -> None:
    """Send `tensors` to global rank `dst`, which calls `receive_from` with tensors of the same shapes; no
    more than a bucket is copied onto `device` at once."""
    for ts in _by_dtype(tensors):
        if len(ts) == 1 and ts[0].numel() * ts[0].element_size() > BUCKET_BYTES:
            for part in _slices(ts[0]):
                dist.send(part.to(device=device, dtype=_wire(part.dtype)), dst=dst)
        else:
            dist.send(_flat(ts, device), dst=dst)


def receive_from(tensors: Iterable[torch.Tensor], src: int, device: torch.device) -> None:
    """Overwrite `tensors` in place with what global rank `src` sends (`send_to`)."""
    for ts in _by_dtype(tensors):
        if len(ts) == 1 and ts[0].numel() * ts[0].element_size() > BUCKET_BYTES:
            t = ts[0]
            whole = t.detach() if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            with torch.no_grad():
                for part in _slices(whole):   # views of `whole`: each slice received, then written in place
                    buf = torch.empty(part.numel(), dtype=_wire(t.dtype), device=device)
                    dist.recv(buf, src=src)
                    part.copy_(buf)
                if not t.is_contiguous():
                    t.copy_(whole)
            continue
        flat = _flat(ts, device) if len(ts) == 1 else \
            torch.empty(sum(t.numel() for t in ts), dtype=_wire(ts[0].dtype), device=device)
        dist.recv(flat, src=src)
        _unflatten_into(ts, flat)


def copy_from(tensors: Iterable[torch.Tensor], src: int, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite `tensors` in place with global rank `src`'s (a broadcast per bucket; collective in `group`)."""
    for ts in _by_dtype(tensors):
        flat = _flat(ts, ts[0].device)
        dist.broadcast(flat, src=src, group=group)
        _unflatten_into(ts, flat)

"""Streams (`IterableDataset`): every rank reads the same stream, cut into global batches, and keeps its slice.

A stream has no indices to permute, so the order is the stream's own: consecutive samples form
global batches of ``global_batch_size``, and each rank keeps the contiguous slice its share of
that step gives it. With workers, worker ``w`` of ``W`` delivers global batches ``w, w + W, ...``;
torch's DataLoader returns the workers' batches round-robin, so the loop sees them in stream order.
That needs every worker to read the same stream: a stream that splits itself by `get_worker_info`
gives each worker another, and its samples would be lost; the workers' first global batches are
compared (`fingerprint`) and such a stream is refused.
The slice is cut in the training process when the loop takes the step, so a split change takes
effect at the next step and needs no lag. A worker sends a plain global batch's small tensors stacked
by shape and dtype (`Packed`), one shared-memory block each instead of one per sample's tensor (a
step's data wait, 64 samples of a tensor and a label: 92 ms, then 2.1 ms); the training process takes
the samples back as they were (`unpack`), rows of those blocks. Other samples travel as they are.
See docs/data.md for what holds for streams.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from hetrain.errors import HetrainError
from hetrain.runtime.batch_tree import flatten
from hetrain.runtime.dataset_names import ScriptDatasetNames


def fingerprint(samples: list[Any], floats: bool = True) -> str:
    """A digest of what a random augmentation leaves alone: the shapes of the samples' tensors and arrays,
    the values of the integer ones (token ids, labels), strings and integers. Samples with no such value
    (all floating-point) are digested whole, float values too, unless `floats` is False (then their
    shapes alone: the ranks' generators part ways once dropout draws on shares of different sizes)."""
    exact: list[bytes] = []      # integers and strings, as they are
    inexact: list[bytes] = []    # floating-point values, digested only where nothing else tells samples apart
    shapes: list[bytes] = []

    for x in flatten(samples)[0]:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            x = (x.to_dense() if x.layout != torch.strided else x).contiguous()   # a sparse one: its values
            x = x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()
        if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "tobytes"):   # a numpy array
            shapes.append(repr((tuple(x.shape), str(x.dtype))).encode())
            (exact if x.dtype.kind in "iub" else inexact).append(x.tobytes())
        elif isinstance(x, (str, bytes, int)):
            exact.append(repr(x).encode())
        elif isinstance(x, float):
            inexact.append(repr(x).encode())
    digest = hashlib.blake2b(digest_size=16)
    for part in shapes + (exact or (inexact if floats else [])):
        digest.update(part)
    return digest.hexdigest()


class _Row:
    """Where a sample's tensor went in a packed global batch: row `row` of stacked block `block`."""

    __slots__ = ("block", "row")

    def __init__(self, block: int, row: int) -> None:
        self.block, self.row = block, row

    def __getstate__(self) -> tuple[int, int]:
        return self.block, self.row

    def __setstate__(self, state: tuple[int, int]) -> None:
        self.block, self.row = state


# a tensor larger than this travels on its own (its block costs little beside its bytes, and stacking copies it)
PACK_MAX_BYTES = 1 << 16
_PLAIN_VALUES = (str, bytes, int, float, bool, complex, type(None), np.ndarray, np.generic)


def _plain(obj: Any, tensors: list[torch.Tensor], storages: set[int]) -> bool:
    """Whether `obj` is built of dicts, lists and tuples (those types exactly) around plain values and
    small tensors that each own their whole storage, none shared: what stacks and rebuilds exactly.
    Collects its tensors in order."""
    kind = type(obj)
    if kind is torch.Tensor:   # not a Parameter or another subclass, which stacking would make plain
        nbytes = obj.numel() * obj.element_size()
        if (obj.layout != torch.strided or obj.requires_grad or obj.is_quantized or nbytes > PACK_MAX_BYTES
                or obj.storage_offset() != 0 or not obj.is_contiguous()
                or obj.untyped_storage().nbytes() != nbytes or (nbytes and obj.data_ptr() in storages)):
            return False   # a view, a shared or expanded tensor, a large one: stacking would copy or part them
        storages.add(obj.data_ptr())
        tensors.append(obj)
        return True
    if kind is dict:
        return all(_plain(v, tensors, storages) for v in obj.values())
    if kind is list or kind is tuple:
        return all(_plain(v, tensors, storages) for v in obj)
    return isinstance(obj, _PLAIN_VALUES) and not isinstance(obj, torch.Tensor)


def _rebuilt(obj: Any, tensor: Any) -> Any:
    """A plain sample (see `_plain`) with each tensor replaced by `tensor(it)`."""
    kind = type(obj)
    if kind is torch.Tensor or kind is _Row:
        return tensor(obj)
    if kind is dict:
        return {k: _rebuilt(v, tensor) for k, v in obj.items()}
    if kind is list or kind is tuple:
        return kind(_rebuilt(v, tensor) for v in obj)
    return obj


class Packed:
    """A global batch whose samples' small tensors travel stacked by (shape, dtype): what a worker sends.
    Samples of any other form (a dataclass, a container subclass, a tensor shared, a view or large) travel
    as they are: rebuilding them could lose their attributes or part what they share."""

    def __init__(self, samples: list[Any]) -> None:
        tensors: list[torch.Tensor] = []
        storages: set[int] = set()   # a tensor two samples share travels as it is, shared
        if not all(_plain(sample, tensors, storages) for sample in samples) or not tensors:
            self.samples, self.blocks = samples, None
            return
        groups: dict[tuple, list[torch.Tensor]] = {}   # (shape, dtype, device) -> its tensors, in order
        index: dict[tuple, int] = {}                     # ... -> its block

        def slot(x: torch.Tensor) -> _Row:
            key = (tuple(x.shape), x.dtype, x.device)
            rows = groups.setdefault(key, [])
            rows.append(x)
            return _Row(index.setdefault(key, len(index)), len(rows) - 1)

        self.samples = [_rebuilt(sample, slot) for sample in samples]
        self.blocks = [torch.stack(rows) for rows in groups.values()]


def unpack(item: Any) -> Any:
    """A (fingerprint, global batch) item as the loop takes it: a packed batch's samples rebuilt."""
    first, batch = item
    if not isinstance(batch, Packed):
        return item
    if batch.blocks is None:
        return first, batch.samples
    rows = [block.unbind(0) for block in batch.blocks]
    return first, [_rebuilt(sample, lambda x: rows[x.block][x.row]) for sample in batch.samples]


class GlobalBatchStream(ScriptDatasetNames, IterableDataset):
    """The samples of a stream grouped into global batches (lists), from batch ``skip`` on."""

    def __init__(self, dataset: Any, global_batch_size: int, *, drop_last: bool = True) -> None:
        object.__setattr__(self, "_hetrain_dataset", dataset)
        object.__setattr__(self, "_hetrain_global_batch_size", global_batch_size)
        object.__setattr__(self, "_hetrain_drop_last", drop_last)
        object.__setattr__(self, "_hetrain_skip", 0)   # global batches of this pass the loop already took (resume)

    def __iter__(self) -> Iterator[tuple[str | None, list[Any]]]:
        """(a fingerprint or None, a global batch): with workers, each worker's first batch carries the
        fingerprint of the pass's first global batch as that worker read it; they must all agree."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        batch: list[Any] = []
        number = 0
        first = digest = None
        for sample in self._hetrain_dataset:
            batch.append(sample)
            if len(batch) == self._hetrain_global_batch_size:
                if number == self._hetrain_skip and workers > 1:
                    first = digest = fingerprint(batch)
                if self._mine(number, worker, workers):
                    yield first, (Packed(batch) if info is not None else batch)   # a worker's: stacked
                    first = None
                batch, number = [], number + 1
        if batch and not self._hetrain_drop_last and number == self._hetrain_skip and workers > 1:
            first = digest = fingerprint(batch)
        if batch and not self._hetrain_drop_last and self._mine(number, worker, workers):
            yield first, (Packed(batch) if info is not None else batch)
        if workers > 1:   # the pass as this worker read it: its global batches and first digest (PassCount)
            yield None, PassEnd(number + (1 if batch and not self._hetrain_drop_last else 0), digest)

    def _mine(self, number: int, worker: int, workers: int) -> bool:
        return number >= self._hetrain_skip and (number - self._hetrain_skip) % workers == worker

    def new_pass(self, skip: int, epoch: int) -> None:
        """The next pass starts at global batch `skip` of epoch `epoch`. A stream with `set_epoch` (Hugging Face's
        IterableDataset, whose shuffle reseeds by it) is told the epoch first, as a DDP loop tells its sampler: it
        read the same order every epoch. Called on every rank, and again with the epoch a resume continues."""
        object.__setattr__(self, "_hetrain_skip", skip)
        set_epoch = getattr(self._hetrain_dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


DIFFERENT_SAMPLES = (
    "the stream gave the DataLoader's workers different samples (their first global batches "
    "differ): hetrain has every worker read the whole stream and keep every num_workers-th "
    "global batch, so a stream that splits itself by get_worker_info() (Hugging Face datasets "
    "and WebDataset's split_by_worker do) would lose the other workers' samples; turn its "
    "worker splitting off, or pass num_workers=0. A stream that draws integers (token windows, "
    "masks) or, holding only floats, any value at random differs by worker too: draw them from "
    "the sample's position in the stream (docs/data.md, Streams)")


STOPPED_WORKERS = (
    "the stream stopped them (Hugging Face datasets stops the workers beyond its shards: 'Too many dataloader "
    "workers'), and the global batches hetrain gives them are lost; hetrain has every worker read the whole "
    "stream, so pass num_workers=1 (one process reading ahead) or 0, or a stream that reads whole in every worker")


class PassEnd:
    """A worker's last item of a pass: the global batches the whole pass held and the digest of its first one,
    as that worker read them (None where it read none)."""

    def __init__(self, batches: int, digest: str | None) -> None:
        self.batches, self.digest = batches, digest


class PassCount:
    """The items of a pass read by several workers, without their `PassEnd`s; once the pass has ended, `check`
    that every global batch came. A worker the stream stopped (Hugging Face datasets stops the workers beyond
    its shards) gives none of its batches: at the pass's start `check_workers` sees it, unless the pass holds
    no more batches than workers and the stopped worker's batch is the last one (a short evaluation stream)."""

    def __init__(self, items: Iterator[Any]) -> None:
        self.items, self.held, self.digests = items, 0, set()

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            if isinstance(item[1], PassEnd):
                self.held = max(self.held, item[1].batches)
                self.digests |= {item[1].digest} - {None}
            else:
                yield item

    def check(self, received: int, skip: int, workers: int) -> None:
        if len(self.digests) > 1:   # a stream split by worker, of no more batches than workers: each kept its own
            raise HetrainError(DIFFERENT_SAMPLES)
        if received < self.held - skip:
            raise HetrainError(
                f"{self.held - skip - received} of the {self.held - skip} global batches of this pass never came: "
                f"some of the DataLoader's {workers} workers gave none, {STOPPED_WORKERS}")


def check_workers(head: list[tuple[str | None, list[Any]]], workers: int) -> None:
    """The workers' first batches of a pass (the loop's first `workers` items) carry the digest of the pass's
    first global batch as each worker read it: they must agree, and there must be one from each worker."""
    digests = [first for first, _ in head if first is not None]
    if len(set(digests)) > 1:
        raise HetrainError(DIFFERENT_SAMPLES)
    if workers > 1 and len(digests) < len(head):   # a worker's second batch came before another worker's first
        raise HetrainError(
            f"{workers - len(digests)} of the DataLoader's {workers} workers gave no global batch while another "
            f"gave several: {STOPPED_WORKERS}")

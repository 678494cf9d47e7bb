"""Streams (`IterableDataset`): every rank reads the same stream, cut into global batches, and keeps its slice.

A stream has no indices to permute, so the order is the stream's own: consecutive samples form
global batches of ``global_batch_size``, and each rank keeps the contiguous slice its share of
that step gives it. With workers, worker ``w`` of ``W`` delivers global batches ``w, w + W, ...``;
torch's DataLoader returns the workers' batches round-robin, so the loop sees them in stream order.
The slice is cut in the training process when the loop takes the step, so a split change takes
effect at the next step and needs no lag. See docs/data.md for what holds for streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info


class GlobalBatchStream(IterableDataset):
    """The samples of a stream grouped into global batches (lists), from batch ``skip`` on."""

    def __init__(self, dataset: Any, global_batch_size: int, *, drop_last: bool = True) -> None:
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.drop_last = drop_last
        self.skip = 0   # global batches of this pass already taken by the loop (resume mid-epoch)

    def __iter__(self) -> Iterator[list[Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        batch: list[Any] = []
        number = 0
        for sample in self.dataset:
            batch.append(sample)
            if len(batch) == self.global_batch_size:
                if self._mine(number, worker, workers):
                    yield batch
                batch, number = [], number + 1
        if batch and not self.drop_last and self._mine(number, worker, workers):
            yield batch

    def _mine(self, number: int, worker: int, workers: int) -> bool:
        return number >= self.skip and (number - self.skip) % workers == worker


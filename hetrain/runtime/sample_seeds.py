"""Random draws made while reading a sample come from the sample, not from who reads it.

A dataset's `__getitem__` that augments (a random crop, noise, masking) draws from the reading
process's generators: a DataLoader worker's, seeded once per worker, or the training process's. What
a sample gets would then depend on which rank and which worker read it, and after what: on the split,
on `num_workers`, on a resume in the middle of an epoch (workers restart at another sample), and
every rank's workers would draw the same numbers. So before each sample is read, torch's CPU
generator, Python's `random` and NumPy's global generator are seeded from (loader seed, epoch,
sample index): a sample's augmentation in an epoch is the same for any world size, split, worker
count or restart, and differs between samples and epochs. Read in the training process
(`num_workers=0`), its generators are put back afterwards, so reading never moves the training
loop's random stream (dropout). A dataset with its own `__getitems__` (a batched read) is seeded
once per read, from its first sample: its draws then follow the split. Seeding costs about 8 us a
sample (Python's `random` most of it); NumPy takes 32 bits of the seed.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler, StackDataset, Subset, get_worker_info

from hetrain.errors import HetrainError, add_note
from hetrain.runtime.dataset_names import ScriptDatasetNames

_MASK = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch (splitmix64 of the three)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) >> 1


def _seed_all(value: int) -> None:
    torch.default_generator.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value & 0xFFFFFFFF)


@contextlib.contextmanager
def _generators_kept() -> Iterator[None]:
    """The reading process's generators as they were before (the training process's random stream)."""
    numpy = sys.modules.get("numpy")
    saved = (torch.default_generator.get_state(), random.getstate(),
             numpy.random.get_state() if numpy is not None else None)
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        random.setstate(saved[1])
        if saved[2] is not None:
            numpy.random.set_state(saved[2])


def _batched_read(dataset: Any) -> Any:
    """The dataset's own batched read (`__getitems__`), or None where it only reads sample by sample (a
    Subset or StackDataset of datasets without one)."""
    if isinstance(dataset, Subset):
        return dataset.__getitems__ if _batched_read(dataset.dataset) is not None else None
    if isinstance(dataset, StackDataset):
        parts = dataset.datasets.values() if isinstance(dataset.datasets, dict) else dataset.datasets
        return dataset.__getitems__ if any(_batched_read(d) is not None for d in parts) else None
    return getattr(dataset, "__getitems__", None)


class SeededSamples(ScriptDatasetNames, Dataset):
    """`dataset` read by (epoch, index) keys, each sample read with the generators seeded from its key."""

    def __init__(self, dataset: Any, seed: int, none_is_an_error: bool = False) -> None:
        object.__setattr__(self, "_hetrain_dataset", dataset)
        object.__setattr__(self, "_hetrain_seed", int(seed))
        # torch's default collate cannot take a None; a script's own collate_fn may drop them (unreadable files)
        object.__setattr__(self, "_hetrain_none_is_an_error", none_is_an_error)

    def __len__(self) -> int:
        return len(self._hetrain_dataset)

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, tuple):   # an index of the script's own (a worker_init_fn reading a sample)
            return self._hetrain_dataset[key]
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        in_worker = get_worker_info() is not None   # a worker's generators serve nothing else
        with contextlib.nullcontext() if in_worker else _generators_kept():
            batched = _batched_read(self._hetrain_dataset)
            if batched is not None and keys:
                _seed_all(sample_seed(self._hetrain_seed, *keys[0]))
                with _named_on_error(keys):
                    return batched([index for _, index in keys])
            out = []
            for epoch, index in keys:
                _seed_all(sample_seed(self._hetrain_seed, epoch, index))
                with _named_on_error([(epoch, index)]):
                    out.append(self._hetrain_dataset[index])
                if out[-1] is None and self._hetrain_none_is_an_error:   # collate: only "found NoneType"
                    raise HetrainError(f"dataset[{index}] returned None: a dataset's __getitem__ returns a sample (a "
                                       "tensor, a tuple or a dict of them); check its return statement")
            return out


@contextlib.contextmanager
def _named_on_error(keys: Sequence[tuple[int, int]]) -> Iterator[None]:
    """An error of the dataset's read carries the samples it was reading (a note, shown with it)."""
    try:
        yield
    except Exception as exc:
        indices = [index for _, index in keys]
        what = (f"sample {indices[0]}" if len(indices) == 1 else
                f"samples {indices[:8]}".rstrip("]") + (", ...]" if len(indices) > 8 else "]"))
        add_note(exc, f"hetrain: while reading {what} of epoch {keys[0][0]} of the dataset")
        raise


class KeyedBatches(Sampler[list[tuple[int, int]]]):
    """A batch sampler's index lists as (epoch, index) keys, the epoch read from it (`sampler.epoch`)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.sampler.epoch
        for indices in self.sampler:
            yield [(epoch, int(i)) for i in indices]

"""A TensorDataset read by one gather per tensor, and a collate_fn that keeps what it gathered."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset


def reads_as_tensor_dataset(dataset: Any) -> bool:
    """Whether `dataset` reads its samples as TensorDataset does: a subclass with a read of its own (an
    augmentation, a label map, a dict per sample) is read through that read, sample by sample."""
    cls = type(dataset)
    return (isinstance(dataset, TensorDataset) and cls.__getitem__ is TensorDataset.__getitem__
            and getattr(cls, "__getitems__", None) is None)


class TensorGather(Dataset):
    """A TensorDataset read by one gather per tensor instead of a tuple per sample (same batch)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.tensor(indices, dtype=torch.long)
        return [t[index] for t in self.tensors]


def as_is(batch: list[Any]) -> list[Any]:
    """A collate_fn that keeps the batch as the dataset or sampler built it."""
    return batch

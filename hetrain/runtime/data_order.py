"""Which samples form each global batch: one permutation per epoch, cut into global batches.

Global batch t of epoch e is the same for any world size and any split (DESIGN.md, invariant 1).
Each rank takes a contiguous slice of it, sized by the shares in effect for that step, so every
sample is seen exactly once per epoch and shares may change between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetrain.errors import HetrainError

_SEEDS = (-(1 << 63), 1 << 64)   # what torch.Generator.manual_seed takes


def generator_seed(value: int) -> int:
    """`value` for torch.Generator.manual_seed: as it is where torch takes it, else wrapped into 64 bits (a seed such
    as torch.initial_seed() times a factor overflowed torch's range and failed at the first batch)."""
    return value if _SEEDS[0] <= value < _SEEDS[1] else value % _SEEDS[1]


class GlobalBatchOrder:
    """Which dataset indices form global batch ``step`` of ``epoch``."""

    def __init__(self, dataset_len: int, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        if global_batch_size < 1:
            raise HetrainError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if dataset_len < 1:
            raise HetrainError("the dataset is empty")
        if drop_last and dataset_len < global_batch_size:
            raise HetrainError(
                f"the dataset has {dataset_len} samples, fewer than one global batch of {global_batch_size}; "
                "lower global_batch_size or pass drop_last=False"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.dataset_len, self.global_batch_size)
        return full if (self.drop_last or rest == 0) else full + 1

    def permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(generator_seed(self.seed + epoch))
                self._perm = torch.randperm(self.dataset_len, generator=g)
            else:
                self._perm = torch.arange(self.dataset_len)
            self._perm_epoch = epoch
        return self._perm

    def batch_size(self, step: int) -> int:
        """Samples in the step's global batch (fewer in a partial last batch)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside epoch of {self.steps_per_epoch} steps")
        return min(self.global_batch_size, self.dataset_len - step * self.global_batch_size)

    def global_batch(self, epoch: int, step: int) -> list[int]:
        start = step * self.global_batch_size
        return self.permutation(epoch)[start : start + self.batch_size(step)].tolist()


def rank_slice(indices: Sequence, shares: Sequence[int], rank: int) -> list:
    """This rank's contiguous part of a global batch."""
    start = sum(shares[:rank])
    return list(indices[start : start + shares[rank]])

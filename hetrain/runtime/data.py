"""Global-batch order and the per-rank loader.

One permutation per epoch over the whole dataset, cut into global batches: global batch t of
epoch e is the same for any world size and any split (DESIGN.md, invariant 1). Each rank takes
a contiguous slice of it, sized by the current shares, so every sample is seen exactly once per
epoch and shares may change between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import TensorDataset, default_collate

from hetrain.errors import HetrainError
from hetrain.planning.batch_split import split_partial

if TYPE_CHECKING:
    from hetrain.runtime.session import Session


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
                g.manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.dataset_len, generator=g)
            else:
                self._perm = torch.arange(self.dataset_len)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, epoch: int, step: int) -> list[int]:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside epoch of {self.steps_per_epoch} steps")
        start = step * self.global_batch_size
        return self.permutation(epoch)[start : start + self.global_batch_size].tolist()


def rank_slice(indices: Sequence[int], shares: Sequence[int], rank: int) -> list[int]:
    """This rank's contiguous part of a global batch."""
    start = sum(shares[:rank])
    return list(indices[start : start + shares[rank]])


def _fetch(dataset: Any, indices: list[int], collate_fn: Callable, probe: int = 0) -> Any:
    if isinstance(dataset, TensorDataset) and collate_fn is default_collate:
        # One gather per tensor instead of collating a tuple per sample; same result.
        index = torch.tensor(indices, dtype=torch.long)
        return [t[index] for t in dataset.tensors]
    if not indices:
        # A rank with no samples this step: a batch of the right structure, every tensor of length 0.
        one = _fetch(dataset, [probe], collate_fn)
        return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, one)
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return collate_fn(getitems(indices))
    return collate_fn([dataset[i] for i in indices])


class HeteroLoader:
    """Iterates one epoch of this rank's slices; `len()` is the steps per epoch, equal on all ranks.

    A rank whose share of a step is 0 receives an empty batch and still takes the step.
    """

    def __init__(self, session: "Session", dataset: Any, order: GlobalBatchOrder,
                 collate_fn: Callable | None = None) -> None:
        self.session = session
        self.dataset = dataset
        self.order = order
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        self.step_in_epoch = 0  # steps of `epoch` already handed out

    def __len__(self) -> int:
        return self.order.steps_per_epoch

    def indices_for(self, epoch: int, step: int, shares: Sequence[int]) -> tuple[list[int], list[int]]:
        """(this rank's indices, the shares used) for a step; partial batches split proportionally."""
        batch = self.order.global_batch(epoch, step)
        if len(batch) != sum(shares):
            shares = split_partial(len(batch), shares)
        return rank_slice(batch, shares, self.session.rank), list(shares)

    def __iter__(self) -> Iterator[Any]:
        if self.step_in_epoch >= len(self):
            self.epoch += 1
            self.step_in_epoch = 0
        while self.step_in_epoch < len(self):
            local, shares = self.indices_for(self.epoch, self.step_in_epoch, self.session.shares)
            self.session._begin_step(len(local), sum(shares))
            self.step_in_epoch += 1
            batch = _fetch(self.dataset, local, self.collate_fn, probe=self.order.permutation(self.epoch)[0].item())
            # one piece, or micro-batches when the plan caps this rank's micro_batch below its share
            yield from self.session._micro_batches(batch)
        # the epoch is complete: the next iteration starts the next one
        self.epoch += 1
        self.step_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.order.seed,
                "global_batch_size": self.order.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["global_batch_size"] != self.order.global_batch_size or state["seed"] != self.order.seed:
            raise HetrainError(
                f"the checkpoint's data order (global batch {state['global_batch_size']}, seed {state['seed']}) "
                f"differs from this loader's ({self.order.global_batch_size}, {self.order.seed}); "
                "resume with the same global_batch_size and seed"
            )
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])

"""Global-batch order and the per-rank loader.

One permutation per epoch over the whole dataset, cut into global batches: global batch t of
epoch e is the same for any world size and any split (DESIGN.md, invariant 1). Each rank takes
a contiguous slice of it, sized by the current shares, so every sample is seen exactly once per
epoch and shares may change between steps.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ContextManager

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import TensorDataset, default_collate

from hetrain.errors import HetrainError
from hetrain.planning.batch_split import split_partial
from hetrain.runtime.batch_transfer import to_device
from hetrain.runtime.memory import micro_batch_sizes, split_batch
from hetrain.runtime.step_state import StepState

log = logging.getLogger("hetrain")


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

    Each batch is on the rank's device. A rank whose share of a step is 0 receives an empty batch
    and still takes the step. Handing out a batch moves the data position (what a checkpoint
    saves): a batch drawn and dropped is a step of data skipped.
    """

    def __init__(self, dataset: Any, order: GlobalBatchOrder, *, rank: int, split: Any, step: StepState,
                 device: torch.device, micro_batch: int | None = None, grad_accum: int = 1,
                 gradient_sync: Callable[[bool], ContextManager] | None = None,
                 collate_fn: Callable | None = None) -> None:
        self.dataset = dataset
        self.order = order
        self.rank = rank
        self.split = split              # anything with a `shares` list (the balancer)
        self.step = step
        self.device = device
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.gradient_sync = gradient_sync or (lambda sync: contextlib.nullcontext())
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        self.step_in_epoch = 0  # steps of `epoch` already handed out
        self.last_fetch_seconds = 0.0  # time the last step's batch took to read, collate and move

    def __len__(self) -> int:
        return self.order.steps_per_epoch

    def indices_for(self, epoch: int, step: int, shares: Sequence[int]) -> tuple[list[int], list[int]]:
        """(this rank's indices, the shares used) for a step; partial batches split proportionally."""
        batch = self.order.global_batch(epoch, step)
        if len(batch) != sum(shares):
            shares = split_partial(len(batch), shares)
        return rank_slice(batch, shares, self.rank), list(shares)

    def __iter__(self) -> Iterator[Any]:
        if self.step.active:
            log.warning("a batch was drawn from the loader and no session.step() followed; iterating the loader "
                        "moves the data position, so that batch's step of data is skipped (docs/porting.md)")
        if self.step_in_epoch >= len(self):
            self.epoch += 1
            self.step_in_epoch = 0
        while self.step_in_epoch < len(self):
            local, shares = self.indices_for(self.epoch, self.step_in_epoch, self.split.shares)
            self.step.begin_step(len(local), sum(shares))
            self.step_in_epoch += 1
            started = time.perf_counter()
            batch = _fetch(self.dataset, local, self.collate_fn, probe=self.order.permutation(self.epoch)[0].item())
            self.last_fetch_seconds = time.perf_counter() - started
            yield from self._pieces(to_device(batch, self.device), len(local))
        # the epoch is complete: the next iteration starts the next one
        self.epoch += 1
        self.step_in_epoch = 0

    def _pieces(self, batch: Any, n: int) -> Iterator[Any]:
        """The step's batch, or its micro-batches when the plan caps this rank's micro_batch below its share."""
        sizes = micro_batch_sizes(n, self.micro_batch, self.grad_accum)
        for i, piece in enumerate(split_batch(batch, sizes, n)):
            last = i == len(sizes) - 1
            self.step.begin_micro(sizes[i], last)
            with self.gradient_sync(last):  # DDP reads it in forward: span the user's whole pass
                yield piece

    @property
    def data_wait_seconds(self) -> float:
        """How long the training loop waited for the last step's batch (all of its reading, here)."""
        return self.last_fetch_seconds

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


def make_loader(dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                rank: int, split: Any, step: StepState, device: torch.device, micro_batch: int | None = None,
                grad_accum: int = 1, gradient_sync: Callable[[bool], ContextManager] | None = None,
                collate_fn: Callable | None = None) -> HeteroLoader:
    """The loader `session.loader()` returns: this rank's part of one global-batch order."""
    order = GlobalBatchOrder(len(dataset), global_batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return HeteroLoader(dataset, order, rank=rank, split=split, step=step, device=device, micro_batch=micro_batch,
                        grad_accum=grad_accum, gradient_sync=gradient_sync, collate_fn=collate_fn)

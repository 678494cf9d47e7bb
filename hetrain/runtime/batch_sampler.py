"""This rank's slice of each global batch, as a torch batch sampler, with split changes scheduled ahead.

A `DataLoader` with workers reads a batch sampler several steps before the training loop uses the
batches (``num_workers * prefetch_factor`` steps). So the split of a step must be known before the
step runs: a change of the split seen when the loop asks for step ``s`` takes effect at step
``s + lag``, where ``lag`` is at least that prefetch depth on every rank (the ranks agree on it).
Every rank sees the balancer's change at the same step (the balancer decides from all-gathered
figures), so every rank schedules it for the same step, and nothing is read twice or skipped.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from hetrain.errors import HetrainError
from hetrain.runtime.environment import whole_number
from hetrain.planning.batch_split import split_partial
from hetrain.runtime.data_order import GlobalBatchOrder


def check_global_batch(global_batch_size: object, world_size: int) -> int:
    """`session.loader()`'s global_batch_size as a whole number of samples, at least one per rank."""
    given = global_batch_size
    global_batch_size = whole_number(global_batch_size)   # an int, or a NumPy integer (a bool is no count)
    if global_batch_size is None:
        whole = isinstance(given, float) and given.is_integer() and 0 < given < 1e9
        raise HetrainError(f"session.loader(..., global_batch_size={reprlib.repr(given)}): the samples of one "
                           f"optimizer step over every rank are a whole number; pass one, e.g. "
                           f"{int(given) if whole else 256}")
    if global_batch_size < world_size:
        raise HetrainError(f"global batch size {global_batch_size} is smaller than the number of ranks "
                           f"({world_size}); use a global batch of at least {world_size}")
    return global_batch_size


def check_order_arguments(shuffle: object, seed: object, drop_last: object) -> tuple[bool, int, bool]:
    """`session.loader()`'s shuffle and drop_last as bools and its seed as a whole number. A flag passed on from a
    command line as a string ("False") would otherwise read as true."""
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
        if not isinstance(value, (bool, np.bool_)):
            parse = " (a command-line flag arrives as a string: parse it, e.g. argparse's action=\"store_true\")" \
                if isinstance(value, str) else ""
            raise HetrainError(f"session.loader(..., {name}={reprlib.repr(value)}): pass True or False{parse}")
    whole = whole_number(seed)
    if whole is None:
        raise HetrainError(f"session.loader(..., seed={reprlib.repr(seed)}): the seed of the sample order is a whole "
                           "number; pass one, e.g. 0")
    return bool(shuffle), whole, bool(drop_last)


class ShareSchedule:
    """The split in effect at each step of the run (steps counted over all epochs from the start)."""

    def __init__(self, shares: Sequence[int], lag: int = 0) -> None:
        self.lag = int(lag)
        self.changes: list[tuple[int, list[int]]] = [(0, [int(s) for s in shares])]

    @property
    def latest(self) -> list[int]:
        """The last split scheduled (possibly not in effect yet)."""
        return self.changes[-1][1]

    def at(self, step: int) -> list[int]:
        """The split of run step ``step``."""
        current = self.changes[0][1]
        for start, shares in self.changes:
            if start > step:
                break
            current = shares
        return current

    def observe(self, step: int, shares: Sequence[int]) -> None:
        """The split is ``shares`` as the loop asks for run step ``step``: a change takes effect at
        ``step + lag``. Called before anything of step ``step + lag`` was read."""
        shares = [int(s) for s in shares]
        if shares == self.latest:
            return
        start = step + self.lag
        if start <= self.changes[-1][0]:
            self.changes[-1] = (self.changes[-1][0], shares)
        else:
            self.changes.append((start, shares))
        # keep the entry in effect at `step` and what follows it
        while len(self.changes) > 1 and self.changes[1][0] <= step:
            self.changes.pop(0)

    def state_dict(self) -> dict:
        return {"lag": self.lag, "changes": [[start, list(shares)] for start, shares in self.changes]}

    def load_state_dict(self, state: dict) -> None:
        self.changes = [(int(start), [int(s) for s in shares]) for start, shares in state["changes"]]


def step_shares(order: GlobalBatchOrder, step: int, shares: Sequence[int]) -> list[int]:
    """The shares a step uses: `shares`, or a partial last batch split in their proportion."""
    size = order.batch_size(step)
    return split_partial(size, shares) if size != sum(shares) else list(shares)


def step_slice(order: GlobalBatchOrder, epoch: int, step: int, shares: Sequence[int],
               rank: int) -> tuple[list[int], list[int]]:
    """(this rank's indices, the shares used) for a step; a partial last batch is split in proportion."""
    used = step_shares(order, step, shares)
    start = step * order.global_batch_size + sum(used[:rank])
    return order.permutation(epoch)[start:start + used[rank]].tolist(), used


class RankBatchSampler(Sampler[list[int]]):
    """Per step of one epoch, from ``first_step`` on, this rank's indices of the global batch.

    The split of each step is read from the schedule when that step's indices are drawn. A rank
    with no samples in a step gets one probe index (the loader cuts the batch to length 0), so a
    step always has a batch of the right structure.
    """

    def __init__(self, order: GlobalBatchOrder, schedule: ShareSchedule, rank: int) -> None:
        self.order = order
        self.schedule = schedule
        self.rank = rank
        self.epoch = 0
        self.first_step = 0       # step of the epoch the next iteration starts at
        self.first_run_step = 0   # the run step that is

    def start(self, epoch: int, step_in_epoch: int, run_step: int) -> None:
        """Where the next iteration starts: the step the training loop consumes next."""
        self.epoch, self.first_step, self.first_run_step = epoch, step_in_epoch, run_step

    def __len__(self) -> int:
        return self.order.steps_per_epoch - self.first_step

    def set_epoch(self, epoch: int) -> None:
        """What a DistributedSampler loop calls each epoch; this loader keeps its own position."""
        raise HetrainError(
            "loader.sampler.set_epoch(): the loader orders each epoch itself and resumes mid-epoch; remove "
            "the call and loop with 'while loader.epoch < epochs: for batch in loader' (docs/porting.md)")

    def __iter__(self) -> Iterator[list[int]]:
        epoch, first, run = self.epoch, self.first_step, self.first_run_step
        for step in range(first, self.order.steps_per_epoch):
            local, _ = step_slice(self.order, epoch, step, self.schedule.at(run + step - first), self.rank)
            yield local if local else [int(self.order.permutation(epoch)[0])]

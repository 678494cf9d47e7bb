"""The global-batch order: same batches for any world size and split; every sample once per epoch."""

import pytest
import torch
from torch.utils.data import TensorDataset

from hetrain.errors import HetrainError
from hetrain.runtime.data import GlobalBatchOrder, HeteroLoader
from hetrain.runtime.step_state import StepState


class _RankView:
    """The split a loader reads (the balancer's `shares`), for one rank."""

    def __init__(self, rank, shares):
        self.rank, self.shares = rank, list(shares)


def _loader(view, dataset, order):
    return HeteroLoader(dataset, order, rank=view.rank, split=view, step=StepState(len(view.shares)),
                        device=torch.device("cpu"))


def _dataset(n):
    return TensorDataset(torch.arange(n))


def _epoch_of_all_ranks(n, global_batch, splits, drop_last=True, epochs=1):
    """Per step, the concatenation of every rank's slice (rank order), with splits changing per step."""
    world = len(splits[0])
    views = [_RankView(r, splits[0]) for r in range(world)]
    order = GlobalBatchOrder(n, global_batch, shuffle=True, seed=7, drop_last=drop_last)
    loaders = [_loader(v, _dataset(n), order) for v in views]
    steps = []
    for _ in range(epochs):
        iters = [iter(ld) for ld in loaders]
        step = 0
        while True:
            batches = [next(it, None) for it in iters]
            if any(b is None for b in batches):
                assert all(b is None for b in batches), "ranks took different numbers of steps"
                break
            steps.append(torch.cat([b[0] for b in batches]).tolist())
            step += 1
            for v in views:
                v.shares = list(splits[step % len(splits)])
    return steps


@pytest.mark.parametrize("splits", [[[12]], [[6, 6]], [[11, 1]], [[5, 4, 3]], [[1, 1, 10], [4, 4, 4], [0, 9, 3]]])
def test_same_global_batches_for_any_world_size_and_split(splits):
    reference = _epoch_of_all_ranks(100, 12, [[12]], epochs=2)
    assert _epoch_of_all_ranks(100, 12, splits, epochs=2) == reference


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_sample_once_per_epoch_and_the_partial_batch(drop_last):
    steps = _epoch_of_all_ranks(100, 12, [[7, 3, 2]], drop_last=drop_last)
    seen = [i for s in steps for i in s]
    assert len(seen) == len(set(seen)), "a sample was repeated"
    if drop_last:
        assert len(steps) == 8 and len(seen) == 96      # the last 4 samples are dropped, never padded
    else:
        assert len(steps) == 9 and sorted(seen) == list(range(100))
        assert len(steps[-1]) == 4                      # the partial batch is kept, not padded


def test_epochs_use_different_permutations_and_resume_position():
    order = GlobalBatchOrder(50, 10, seed=1)
    assert order.global_batch(0, 0) != order.global_batch(1, 0)
    assert sorted(sum((order.global_batch(1, s) for s in range(5)), [])) == list(range(50))
    view = _RankView(0, [10])
    loader = _loader(view, _dataset(50), order)
    it = iter(loader)
    first_two = []
    for _ in range(2):
        first_two.append(next(it)[0].tolist())
        loader.step.finish(0.0, None)   # session.step(): a batch given no step is not in the position saved
    state = loader.state_dict()
    resumed = _loader(_RankView(0, [10]), _dataset(50), GlobalBatchOrder(50, 10, seed=1))
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in it]
    assert first_two == [order.global_batch(0, 0), order.global_batch(0, 1)]


def test_clear_errors():
    with pytest.raises(HetrainError, match="global_batch_size"):
        GlobalBatchOrder(10, 0)
    with pytest.raises(HetrainError, match="fewer than one global batch"):
        GlobalBatchOrder(10, 20)

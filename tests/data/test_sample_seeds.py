"""A sample's random augmentation is the sample's: the same for any world size, split, worker count or
mid-epoch resume, different between samples (every rank's workers drew the same numbers), and reading
never moves the training process's random stream."""

import random

import numpy as np
import torch
from torch.utils.data import Dataset

from hetrain.runtime.data import make_loader
from hetrain.runtime.step_state import StepState

N, GLOBAL = 40, 8


class Augmented(Dataset):
    """Each sample: its index and a draw from each of torch's, Python's and NumPy's generators."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return i, torch.rand(2), random.random(), float(np.random.rand())


class _Split:
    def __init__(self, shares):
        self.shares = list(shares)


def _loader(rank, shares, **options):
    return make_loader(Augmented(), GLOBAL, shuffle=True, seed=5, rank=rank, split=_Split(shares),
                       step=StepState(len(shares)), device=torch.device("cpu"), **options)


def _record(out, epoch, batch):
    index, t, r, n = batch
    for k in range(len(index)):
        out[(epoch, int(index[k]))] = (tuple(t[k].tolist()), float(r[k]), float(n[k]))


def _draws(loaders, epochs=2):
    """(epoch, index) -> the sample's draws, over every rank's batches."""
    out = {}
    for epoch in range(epochs):
        for batches in zip(*loaders):
            for batch in batches:
                _record(out, epoch, batch)
    return out


def test_a_samples_draws_do_not_depend_on_ranks_split_or_workers():
    one = _draws([_loader(0, [GLOBAL])])
    assert len(one) == 2 * N
    assert len(set(one.values())) == 2 * N          # no two samples (or epochs of one) share their draws
    for shares, workers in (([3, 5], 0), ([3, 5], 2), ([2, 3, 3], 1), ([6, 2], 2)):
        many = _draws([_loader(r, shares, num_workers=workers) for r in range(len(shares))])
        assert many == one, (shares, workers)


def test_a_resume_mid_epoch_with_workers_reads_the_rest_with_the_same_draws():
    whole = _draws([_loader(0, [GLOBAL], num_workers=2)])
    first, seen = _loader(0, [GLOBAL], num_workers=2), {}
    batches = iter(first)
    for _ in range(3):   # three steps, then the process stops (workers had read ahead)
        _record(seen, 0, next(batches))
    state = first.state_dict()
    del batches
    second = _loader(0, [GLOBAL], num_workers=2, persistent_workers=True)
    second.load_state_dict(state)
    while second.epoch < 2:
        epoch = second.epoch
        for batch in second:
            _record(seen, epoch, batch)
    assert seen == whole


def test_reading_in_the_training_process_leaves_its_random_stream_alone():
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    _draws([_loader(0, [GLOBAL])], epochs=1)
    after = (torch.rand(1).item(), random.random(), float(np.random.rand()))
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert after == (torch.rand(1).item(), random.random(), float(np.random.rand()))


class _PerWorkerHandle(Dataset):
    """torch's pattern for a file or database handle opened in each worker by worker_init_fn."""

    seed = 1234
    handle = None

    def __len__(self):
        return N

    def __getitem__(self, i):
        if getattr(self, "handle", None) is None:
            raise RuntimeError("handle not opened")
        return i, torch.rand(2), random.random(), float(np.random.rand())


def _open_handle(worker_id):
    dataset = torch.utils.data.get_worker_info().dataset
    assert dataset.seed == 1234 and dataset.handle is None   # the dataset's own names, not the loader's
    dataset.handle = f"opened by worker {worker_id}"
    assert dataset[3][0] == 3   # and its own indices


def test_a_worker_init_fn_reaches_the_scripts_dataset_and_a_stack_of_datasets_reads_sample_by_sample():
    loader = make_loader(_PerWorkerHandle(), GLOBAL, shuffle=True, seed=5, rank=0, split=_Split([GLOBAL]),
                         step=StepState(1), device=torch.device("cpu"), num_workers=2, worker_init_fn=_open_handle)
    assert len(_draws([loader], epochs=1)) == N
    stacked = [make_loader(torch.utils.data.StackDataset(Augmented()), GLOBAL, shuffle=True, seed=5, rank=r,
                           split=_Split(shares), step=StepState(len(shares)), device=torch.device("cpu"))
               for shares in ([GLOBAL], [3, 5]) for r in range(len(shares))]
    one, two = [], []
    for batches in zip(*stacked):   # StackDataset has __getitems__ even when its parts read sample by sample
        one += [tuple(map(float, b[0][2].reshape(-1))) for b in batches[:1]]
        two += [tuple(map(float, b[0][2].reshape(-1))) for b in batches[1:]]
    assert sorted(x for xs in one for x in xs) == sorted(x for xs in two for x in xs)


class _PerWorkerStream(torch.utils.data.IterableDataset):
    """A stream whose worker_init_fn opens a handle per worker on get_worker_info().dataset."""

    seed = 1234
    handle = None

    def __iter__(self):
        if self.handle is None:
            raise RuntimeError("handle not opened")
        return iter(range(N))


def _open_stream_handle(worker_id):
    dataset = torch.utils.data.get_worker_info().dataset
    assert dataset.seed == 1234 and dataset.handle is None   # the stream's own names, not the loader's
    dataset.handle = f"opened by worker {worker_id}"


def test_a_worker_init_fn_reaches_the_scripts_stream():
    loader = make_loader(_PerWorkerStream(), GLOBAL, shuffle=False, seed=5, rank=0, split=_Split([GLOBAL]),
                         step=StepState(1), device=torch.device("cpu"), num_workers=2,
                         worker_init_fn=_open_stream_handle)
    assert sorted(int(i) for batch in loader for i in batch) == list(range(N))


class _Relabelled(torch.utils.data.TensorDataset):
    """A TensorDataset whose own read maps the labels and adds a field, as a script's subclass does."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"x": x * 2, "y": y + 100, "index": i}


def test_a_tensor_dataset_subclass_is_read_through_its_own_getitem():
    x, y = torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.arange(N)
    loader = make_loader(_Relabelled(x, y), GLOBAL, shuffle=True, seed=5, rank=0, split=_Split([GLOBAL]),
                         step=StepState(1), device=torch.device("cpu"))
    batches = list(loader)
    assert len(batches) == N // GLOBAL
    for batch in batches:
        assert torch.equal(batch["x"].squeeze(1), 2 * batch["index"].float())
        assert torch.equal(batch["y"], batch["index"] + 100)
    assert sorted(int(i) for b in batches for i in b["index"]) == list(range(N))

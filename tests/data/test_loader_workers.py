"""The loader on torch's DataLoader: invariants with workers and prefetch, split changes scheduled
ahead, resume mid-epoch with batches in flight, and one-line errors for what a DataLoader user passes."""

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hetrain.errors import HetrainError
from hetrain.runtime.data import make_loader
from hetrain.runtime.data_order import GlobalBatchOrder
from hetrain.runtime.step_state import StepState


class _Split:
    """What the loader reads of the balancer: its decided `shares`."""

    def __init__(self, shares):
        self.shares = list(shares)


def _loader(rank, split, n=100, global_batch=12, **options):
    return make_loader(TensorDataset(torch.arange(n)), global_batch, shuffle=True, seed=7, rank=rank, split=split,
                       step=StepState(len(split.shares)), device=torch.device("cpu"), **options)


def _run(loaders, splits, changes, epochs=2):
    """Every rank's batches per step; `changes[k]` is the split decided after step k-1 (as the balancer does)."""
    steps = []
    for _ in range(epochs):
        iters = [iter(ld) for ld in loaders]
        while True:
            if len(steps) in changes:
                for s in splits:
                    s.shares = list(changes[len(steps)])
            batches = [next(it, None) for it in iters]
            if any(b is None for b in batches):
                assert all(b is None for b in batches), "ranks took different numbers of steps"
                break
            steps.append([b[0].tolist() for b in batches])
    return steps


def test_workers_and_prefetch_keep_the_global_batches_and_apply_a_split_change_a_prefetch_depth_later():
    splits = [_Split([6, 6]) for _ in range(2)]
    loaders = [_loader(r, splits[r], num_workers=2, prefetch_factor=2) for r in range(2)]
    assert loaders[0].lag == 4                      # 2 workers x prefetch 2: indices are read 4 steps ahead
    steps = _run(loaders, splits, {3: [9, 3], 9: [2, 10]})
    order = GlobalBatchOrder(100, 12, seed=7)
    reference = [order.global_batch(e, s) for e in range(2) for s in range(order.steps_per_epoch)]
    assert [a + b for a, b in steps] == reference   # the same global batches as one process would read
    sizes = [[len(a), len(b)] for a, b in steps]
    # decided before step 3 -> used from step 3 + 4; decided before step 9 -> from step 13 (mid-epoch 2)
    assert sizes == [[6, 6]] * 7 + [[9, 3]] * 6 + [[2, 10]] * 3
    for epoch in range(2):
        seen = [i for a, b in steps[8 * epoch: 8 * epoch + 8] for i in a + b]
        assert len(seen) == len(set(seen)) == 96    # every sample at most once, 96 of 100 (drop_last)


def test_without_workers_a_change_applies_at_the_next_step():
    splits = [_Split([6, 6]) for _ in range(2)]
    loaders = [_loader(r, splits[r]) for r in range(2)]
    assert loaders[0].lag == 0
    sizes = [[len(a), len(b)] for a, b in _run(loaders, splits, {3: [9, 3]}, epochs=1)]
    assert sizes == [[6, 6]] * 3 + [[9, 3]] * 5


def test_a_rank_with_no_samples_gets_an_empty_batch_from_workers():
    splits = [_Split([12, 0]) for _ in range(2)]
    loaders = [_loader(r, splits[r], num_workers=1) for r in range(2)]
    steps = _run(loaders, splits, {}, epochs=1)
    assert all(len(a) == 12 and b == [] for a, b in steps)


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_mid_epoch_with_batches_in_flight_equals_the_uninterrupted_run(persistent):
    """Stopped after 5 steps, with 4 steps prefetched and a split change scheduled but not yet in
    effect: the resumed loader hands out exactly what the uninterrupted one does."""
    def run(stop=None, state=None):
        split = _Split([6, 6])
        loader = _loader(1, split, num_workers=2, prefetch_factor=2, persistent_workers=persistent)
        if state is not None:
            loader.load_state_dict(state)
            split.shares = [9, 3]                    # the balancer's state comes back with the checkpoint
        out = []
        for _ in range(2):
            for (batch,) in loader:
                out.append(batch.tolist())
                loader.step.finish(0.0, None)   # session.step(): a batch given no step is not in the position saved
                if len(out) == 2 and state is None:
                    split.shares = [9, 3]           # seen as step 2 is asked for: used from step 2 + 4
                if stop is not None and len(out) == stop:
                    return out, loader.state_dict()
        return out, None

    straight, _ = run()
    first, state = run(stop=5)
    rest, _ = run(state=state)
    assert first + rest[: len(straight) - 5] == straight
    assert [len(b) for b in straight[4:8]] == [6, 6, 3, 3]   # the change was pending at the save


def test_a_dataloader_where_a_dataset_belongs_is_a_one_line_error_naming_the_fix():
    dl = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=0)
    with pytest.raises(HetrainError) as e:
        make_loader(dl, 8, rank=0, split=_Split([4, 4]), step=StepState(2), device=torch.device("cpu"))
    assert "\n" not in str(e.value) and "loader.dataset" in str(e.value) and "num_workers" in str(e.value)
    with pytest.raises(HetrainError, match="sampler="):
        _loader(0, _Split([6, 6]), sampler=[0, 1])


def test_a_misspelt_or_owned_dataloader_option_is_a_one_line_error_naming_the_fix():
    with pytest.raises(HetrainError, match=r"num_wrkers=\): not an option of torch's DataLoader; did you mean num_workers=\?"):
        _loader(0, _Split([6, 6]), num_wrkers=2)
    with pytest.raises(HetrainError, match=r"not an option of torch's DataLoader; its options: .*pin_memory"):
        _loader(0, _Split([6, 6]), zzz=1)
    with pytest.raises(HetrainError, match=r"generator=\) is decided by hetrain \(the workers' seeds, from seed\)"):
        _loader(0, _Split([6, 6]), generator=torch.Generator())


def test_dataloader_options_keep_their_meaning():
    seen = []
    loader = _loader(0, _Split([12]), collate_fn=lambda samples: ("mine", len(samples)),
                     worker_init_fn=lambda worker: None, num_workers=1)
    for batch in loader:
        seen.append(batch)
    assert seen == [("mine", 12)] * 8               # the user's collate_fn gets this rank's samples


class _Stream(torch.utils.data.IterableDataset):
    """Samples 0..47 with an integer label; `split_by_worker` reads only this worker's share, as torch's
    IterableDataset example and Hugging Face streams do; `augment` adds noise from the worker's RNG."""

    def __init__(self, split_by_worker=False, augment=False, samples=48):
        self.split_by_worker, self.augment, self.samples = split_by_worker, augment, samples

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None and self.split_by_worker else (0, 1)
        for i in range(first, self.samples, step):
            x = torch.tensor([float(i)])
            yield (x + torch.rand(1) if self.augment else x), torch.tensor(i)


def _stream_ids(stream, **options):
    loader = make_loader(stream, 8, shuffle=False, seed=0, rank=0, split=_Split([8]), step=StepState(1),
                         device=torch.device("cpu"), **options)
    ids = []
    for _, i in loader:
        ids += i.tolist()
        loader.step.finish(8, None)
    return ids


def test_a_stream_that_splits_itself_across_workers_is_refused_not_half_lost():
    assert _stream_ids(_Stream(), num_workers=2) == list(range(48))
    assert _stream_ids(_Stream(augment=True), num_workers=2) == list(range(48))   # random noise is no split
    assert _stream_ids(_Stream(split_by_worker=True), num_workers=0) == list(range(48))
    with pytest.raises(HetrainError, match=r"splits itself by get_worker_info\(\) .* num_workers=0"):
        _stream_ids(_Stream(split_by_worker=True), num_workers=2)
    for samples in (8, 16):   # no more global batches than workers: each worker keeps its own, half is lost
        with pytest.raises(HetrainError, match=r"splits itself by get_worker_info\(\) .* num_workers=0"):
            _stream_ids(_Stream(split_by_worker=True, samples=samples), num_workers=2, drop_last=False)
    assert _stream_ids(_Stream(samples=16), num_workers=2, drop_last=False) == list(range(16))


class _OneShardStream(torch.utils.data.IterableDataset):
    """Samples 0..47 read whole by worker 0, while the other workers stop at once: what a Hugging Face stream of
    one shard does with num_workers=2 ('Too many dataloader workers ... Stopping 1 dataloader workers')."""

    def __init__(self, samples=48):
        self.samples = samples

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id > 0:
            return
        for i in range(self.samples):
            yield torch.tensor([float(i)]), torch.tensor(i)


def test_a_stream_that_stops_the_workers_beyond_its_shards_is_refused_not_read_in_part():
    """Only worker 0 gave batches and its first alone carried a digest: the check passed, and the global batches
    given to worker 1 (every other one) were lost from every epoch without a word."""
    with pytest.raises(HetrainError, match=r"1 of the DataLoader's 2 workers gave no global batch while another "
                                           r"gave several.*Too many dataloader workers.*num_workers=1"):
        _stream_ids(_OneShardStream(), num_workers=2)
    with pytest.raises(HetrainError, match=r"2 of the DataLoader's 3 workers gave no global batch"):
        _stream_ids(_OneShardStream(32), num_workers=3)   # a short stream: fewer batches came than workers
    with pytest.raises(HetrainError, match=r"1 of the 2 global batches of this pass never came.*num_workers=1"):
        _stream_ids(_OneShardStream(16), num_workers=2)   # no more batches than workers: seen at the pass's end
    assert _stream_ids(_OneShardStream(8), num_workers=2) == list(range(8))   # one batch: worker 0's, whole
    assert _stream_ids(_OneShardStream(), num_workers=1) == list(range(48))


class _EpochStream(torch.utils.data.IterableDataset):
    """A stream whose shuffle reseeds by its epoch, as a Hugging Face stream's does once told by set_epoch()."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(48, generator=torch.Generator().manual_seed(self.epoch)).tolist():
            yield torch.tensor([float(i)]), torch.tensor(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_with_set_epoch_is_told_each_epoch_and_reshuffles(workers):
    """Never told, a Hugging Face stream read the same order every epoch (a DDP loop calls set_epoch itself)."""
    loader = make_loader(_EpochStream(), 8, shuffle=False, seed=0, rank=0, split=_Split([8]), step=StepState(1),
                         device=torch.device("cpu"), num_workers=workers)
    epochs = []
    while loader.epoch < 3:
        ids = []
        for _, i in loader:
            ids += i.tolist()
            loader.step.finish(8, None)
        epochs.append(ids)
    assert epochs == [torch.randperm(48, generator=torch.Generator().manual_seed(e)).tolist() for e in range(3)]


class _FloatStream(torch.utils.data.IterableDataset):
    """Floats only (a regression stream): nothing but the values tells one worker's stream from another's."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(first, 48, step):
            yield torch.tensor([float(i)]), torch.tensor([2.0 * i])


def test_a_float_stream_split_across_workers_is_refused_before_its_first_step():
    loader = make_loader(_FloatStream(), 8, shuffle=False, seed=0, rank=0, split=_Split([8]), step=StepState(1),
                         device=torch.device("cpu"), num_workers=2)
    with pytest.raises(HetrainError, match=r"workers different samples"):
        next(iter(loader))   # the first batch is not handed out: no step trains on half the stream


def test_a_stream_shorter_than_a_global_batch_is_an_error_not_an_empty_epoch():
    short = [(torch.tensor([float(i)]), torch.tensor(i)) for i in range(5)]

    class Short(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(short)

    with pytest.raises(HetrainError, match=r"ended before one global batch of 8 samples \(drop_last=True"):
        _stream_ids(Short())
    assert _stream_ids(Short(), drop_last=False) == [0, 1, 2, 3, 4]


def test_a_distributed_samplers_set_epoch_left_in_the_loop_names_the_fix():
    loader = _loader(0, _Split([6, 6]))
    with pytest.raises(HetrainError, match=r"set_epoch\(\): the loader orders each epoch itself"):
        loader.sampler.set_epoch(1)
    with pytest.raises(HetrainError, match=r"loader.set_epoch\(1\): the loader orders each epoch itself"):
        loader.set_epoch(1)   # the habit of a loop written for Accelerate
    with pytest.raises(HetrainError, match=r"set_epoch\(\): the loader orders each epoch itself"):
        loader.batch_sampler.set_epoch(1)   # and of Accelerate's own loader: a bare AttributeError


def test_dataloaders_own_defaults_passed_through_are_let_be_and_a_distributed_sampler_is_named():
    """`sampler=sampler if ddp else None`, generator=None: DataLoader's defaults, refused as options hetrain
    decides; a DistributedSampler left from the DDP script got the advice meant for a weighted sampler."""
    loader = _loader(0, _Split([6, 6]), sampler=None, batch_sampler=None, generator=None)
    assert sum(len(b[0]) for b in loader) == 6 * len(loader)
    sampler = torch.utils.data.DistributedSampler(TensorDataset(torch.arange(12)), num_replicas=2, rank=0)
    with pytest.raises(HetrainError, match=r"a DistributedSampler gives each rank an even part.*pass its shuffle and seed"):
        _loader(0, _Split([6, 6]), sampler=sampler)


def test_a_weighted_sampler_is_refused_naming_how_to_keep_its_weights():
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 12, 12)
    with pytest.raises(HetrainError, match=r"sampler=\) is decided by hetrain.*Subset\(dataset, indices\) with shuffle=False"):
        _loader(0, _Split([6, 6]), sampler=weighted)


def test_a_stream_that_can_be_read_once_names_its_iter_at_the_second_epoch():
    class Once(torch.utils.data.IterableDataset):
        def __init__(self):
            self.samples = iter([(torch.tensor([float(i)]), torch.tensor(i)) for i in range(16)])

        def __iter__(self):
            return self.samples

    loader = make_loader(Once(), 8, shuffle=False, seed=0, rank=0, split=_Split([8]), step=StepState(1),
                         device=torch.device("cpu"))
    for _ in loader:
        loader.step.finish(8, None)
    with pytest.raises(HetrainError, match=r"no global batch in epoch 1 after earlier epochs did: its __iter__"):
        for _ in loader:
            loader.step.finish(8, None)


def test_a_streams_digest_leaves_its_samples_as_they_are():
    """Samples that are dataclasses whose __post_init__ reads a tensor are digested without rebuilding them."""
    import dataclasses

    from hetrain.runtime.stream import fingerprint

    @dataclasses.dataclass
    class Sample:
        x: torch.Tensor
        label: torch.Tensor

        def __post_init__(self):
            self.size = self.x.numel()

    a, b = Sample(torch.ones(2), torch.tensor(1)), Sample(torch.zeros(2), torch.tensor(1))
    assert fingerprint([a]) == fingerprint([b]) != fingerprint([Sample(torch.ones(2), torch.tensor(2))])


class _Varied(torch.utils.data.IterableDataset):
    """Samples of many structures: token ids of varying length, a dict subclass, a string, a nested tuple,
    a float tensor of two dtypes, a plain int."""

    def __iter__(self):
        for i in range(40):
            ids = torch.arange(i % 5 + 1) + i
            yield {"ids": ids, "pair": (torch.full((2,), float(i)), torch.tensor(i, dtype=torch.float64)),
                   "text": f"s{i}", "label": i % 3}


def _padded(samples):
    width = max(len(s["ids"]) for s in samples)
    return {"ids": torch.stack([torch.nn.functional.pad(s["ids"], (0, width - len(s["ids"]))) for s in samples]),
            "pair": torch.stack([s["pair"][0] for s in samples]), "wide": torch.stack([s["pair"][1] for s in samples]),
            "text": [s["text"] for s in samples], "label": torch.tensor([s["label"] for s in samples])}


def _stream_batches(stream=None, rank=1, shares=(5, 3), collate_fn=_padded, **options):
    """One rank's batches of a stream, global batches of 8 (`_Varied`, rank 1 of shares 5/3, by default)."""
    loader = make_loader(stream or _Varied(), 8, shuffle=False, seed=0, rank=rank, split=_Split(shares),
                         step=StepState(len(shares)), device=torch.device("cpu"), collate_fn=collate_fn, **options)
    batches = []
    for batch in loader:
        batches.append(batch)
        loader.step.finish(8, None)
    return batches


def test_a_streams_samples_come_from_workers_as_they_were_read():
    """Workers send a global batch's tensors stacked by shape and dtype (one block each: 64 samples' tensors
    one by one cost 11.8 ms a global batch): the loop gets the same samples, in the same collate, as
    without workers."""
    from hetrain.runtime.stream import Packed, unpack

    want, got = _stream_batches(), _stream_batches(num_workers=2)
    assert len(want) == len(got) == 5
    for w, g in zip(want, got):
        assert w.keys() == g.keys() and w["text"] == g["text"]
        for key in ("ids", "pair", "wide", "label"):
            assert w[key].dtype == g[key].dtype and torch.equal(w[key], g[key]), key
    samples = list(_Varied())[:8]
    packed = Packed(samples)
    assert len(packed.blocks) == 7   # ids of lengths 1..5, the pair's float32 row and its float64 scalar
    first, back = unpack(("digest", packed))
    assert first == "digest" and [s["text"] for s in back] == [s["text"] for s in samples]
    assert all(torch.equal(a["ids"], b["ids"]) and a["pair"][1].dtype == b["pair"][1].dtype
               for a, b in zip(samples, back))


@dataclasses.dataclass
class _Labelled:
    x: torch.Tensor
    label: torch.Tensor = dataclasses.field(init=False, default=None)


class _Tagged(list):
    tag = None


class _Unusual(torch.utils.data.IterableDataset):
    """Samples that stacking and rebuilding would change: a dataclass field set after construction, a list
    subclass's attribute, a tensor held twice and as a view, a Parameter, a sparse tensor."""

    def __iter__(self):
        shared = torch.arange(4.0)
        for i in range(24):
            labelled = _Labelled(torch.tensor([float(i)]))
            labelled.label = torch.tensor(i % 3)
            tagged = _Tagged([torch.tensor(i)])
            tagged.tag = f"src{i % 2}"
            x = torch.full((4,), float(i))
            yield {"labelled": labelled, "tagged": tagged, "x": x, "same": x, "head": x[:2], "shared": shared,
                   "param": torch.nn.Parameter(torch.tensor([float(i)])),
                   "sparse": torch.sparse_coo_tensor([[0], [i % 3]], [float(i)], (2, 3))}


def _as_read(samples):
    """What a collate sees of each sample: its attributes read here, its x changed in place."""
    for s in samples:
        s["x"].sub_(1000)   # in place: a sample's "same" and "head" are its "x"
        s["labelled"], s["tagged"] = s["labelled"].label, s["tagged"].tag
    return samples


def _unusual_batches(**options):
    return _stream_batches(_Unusual(), 0, (8,), _as_read, **options)


def test_samples_that_stacking_would_change_come_from_workers_as_they_were_read():
    """Stacking every tensor lost a dataclass field set after construction and a list subclass's attribute,
    parted a tensor from its alias and its view, made a Parameter plain; a sparse tensor crashed the
    workers' comparison of their first batches."""
    for got, want in zip(_unusual_batches(num_workers=2), _unusual_batches(), strict=True):
        for g, w in zip(got, want, strict=True):
            assert g["labelled"] is not None and torch.equal(g["labelled"], w["labelled"])
            assert g["tagged"] == w["tagged"] is not None
            assert torch.equal(g["same"], w["x"]) and torch.equal(g["head"], w["x"][:2]) and g["x"][0] < -900
            assert type(g["param"]) is torch.nn.Parameter and torch.equal(g["sparse"].to_dense(),
                                                                           w["sparse"].to_dense())


class _Failing(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 17:
            raise ValueError("boom")
        return torch.tensor([float(i)])


class _FailingBatched(_Failing):
    def __getitems__(self, indices):
        return [self[i] for i in indices]


def test_a_sample_that_fails_to_read_is_named_by_index_and_epoch_also_from_a_worker():
    """The launcher's one line named the rank only, and from a worker not even the error (torch's wrapper
    and the worker's frames filled it): now the dataset's own error and the sample it was reading."""
    from torch._utils import ExceptionWrapper

    from hetrain.runtime.sample_seeds import SeededSamples
    from hetrain.runtime.failure_record import one_line

    with pytest.raises(ValueError) as raised:
        SeededSamples(_Failing(), seed=0)[(3, 17)]
    assert one_line(raised.value) == "ValueError: boom (while reading sample 17 of epoch 3 of the dataset)"
    with pytest.raises(ValueError) as raised:
        SeededSamples(_FailingBatched(), seed=0).__getitems__([(0, i) for i in range(10, 20)])
    assert "while reading samples [10, 11, 12, 13, 14, 15, 16, 17, ...] of epoch 0" in one_line(raised.value)
    try:   # what a DataLoader worker sends back, raised again in the training process
        SeededSamples(_Failing(), seed=0)[(0, 17)]
    except ValueError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(ValueError) as raised:
        wrapped.reraise()
    assert one_line(raised.value) == ("ValueError: boom (in DataLoader worker process 1) "
                                      "(while reading sample 17 of epoch 0 of the dataset)")


@pytest.mark.parametrize("error, line", [
    (ValueError("shape mismatch:\n    expected (3,)\n    got (4,)"), "ValueError: shape mismatch: expected (3,) got (4,)"),
    (ValueError(), "ValueError"),
    (KeyError("label"), "KeyError: 'label'"),
])
def test_a_worker_error_of_several_lines_or_none_keeps_its_type_and_message(error, line):
    from torch._utils import ExceptionWrapper

    from hetrain.runtime.failure_record import one_line

    try:
        raise error
    except Exception:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(type(error)) as raised:
        wrapped.reraise()
    assert one_line(raised.value) == f"{line} (in DataLoader worker process 0)"
    quoted = RuntimeError("rank 1 failed: " + str(raised.value))   # not torch's wrapper: its own type stays
    assert one_line(quoted).startswith("RuntimeError: rank 1 failed: Caught")


GARBAGE_AT_FORK = '''
import gc

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
import hetrain


class Collecting(Dataset):
    """A dataset whose reads collect garbage in the worker, as an allocation-heavy one may at any time."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        gc.collect()
        return torch.randn(4), torch.randn(1)


def trial():
    session = hetrain.Session()
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), 8):
        session.backward(F.mse_loss(model(x), y))
        session.step()
    session.close()

    class Trainer:   # holds the model in a reference cycle, as a trainer object with callbacks does
        pass

    t = Trainer()
    t.me, t.model = t, model


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["frozen"]:
        gc.freeze()   # the script froze its heap early (before forking, as Python's docs advise): later objects not
    gc.disable()   # no collection in this process: the first trial's model is garbage when the workers start
    trial()
    session = hetrain.Session()
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(Collecting(), global_batch_size=8, num_workers=1):
        session.backward(F.mse_loss(model(x), y))
        session.step()
    session.close()
    print("trained", flush=True)
'''


@pytest.mark.parametrize("frozen", [False, True])
def test_workers_started_beside_an_earlier_sessions_model_in_a_reference_cycle_do_not_hang(tmp_path, frozen):
    """A model of an earlier session (a sweep's trial, a notebook cell) left in a reference cycle holds its process
    group; a DataLoader worker forked before the rank collected it collected it itself, and its destructor waited
    on threads the fork did not copy: the worker, and the rank waiting for its first batch, hung for good."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "job.py"
    script.write_text(GARBAGE_AT_FORK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.Popen([sys.executable, str(script), *(["frozen"] if frozen else [])], env={**env, "PYTHONPATH": str(Path(__file__).parents[2])},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        out, err = "", "hung"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # a hung worker ignores SIGTERM: the whole group goes
        except ProcessLookupError:
            pass
    assert "trained" in out, err[-2000:]

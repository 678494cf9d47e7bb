"""What every rank must read alike is checked before the first step: a stream split by rank or shuffled
differently per rank (it would lose and repeat samples silently), and a batch holding an object hetrain
cannot cut for a rank with fewer samples (it crashed at the end of the first epoch)."""

import random

import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.runtime.batch_tree import check_cuttable
from hetrain.runtime.memory import empty_batch, slice_batch
from tests.distributed import run_ranks


class Numbers(torch.utils.data.IterableDataset):
    """Samples 0..n-1; `how` is what a ported DDP script already does to its stream."""

    def __init__(self, n, how):
        self.n, self.how = n, how

    def __iter__(self):
        import torch.distributed as dist

        ids = list(range(self.n))
        if self.how == "by-rank":
            ids = ids[dist.get_rank()::dist.get_world_size()]
        elif self.how == "shuffle-buffer":   # Python's global random: another state on every rank
            random.seed(dist.get_rank())
            random.shuffle(ids)
        if self.how == "float-split":   # floats only (a regression stream), split by rank
            for i in ids[dist.get_rank()::dist.get_world_size()]:
                yield torch.tensor([float(i)]), torch.tensor([2.0 * i])
            return
        if self.how == "float-noise":   # an augmentation from each rank's own generator, floats only
            g = torch.Generator().manual_seed(dist.get_rank())
            for i in ids:
                yield torch.tensor([float(i)]) + torch.randn(1, generator=g), torch.tensor([float(i)])
            return
        for i in ids:
            yield torch.tensor([float(i)]), i


class Batch:
    def __init__(self, samples):
        self.x = torch.stack([s[0] for s in samples])
        self.y = torch.tensor([s[1] for s in samples])


def _first_batches(rank, world):
    import types

    import torch.distributed as dist

    from hetrain.runtime.data import make_loader
    from hetrain.runtime.step_state import StepState

    dist.init_process_group("gloo")
    read = {}
    for how in ("same", "float-noise", "float-split", "by-rank", "shuffle-buffer", "object-never-cut", "object-batch"):
        common = dict(rank=rank, split=types.SimpleNamespace(shares=[8, 8]), step=StepState(world),
                      device=torch.device("cpu"))
        if how == "object-never-cut":   # drop_last, no micro-batches: no step cuts it, so it is let be
            data = torch.utils.data.TensorDataset(torch.randn(33, 1), torch.arange(33))
            loader = make_loader(data, 16, collate_fn=Batch, **common)
        elif how == "object-batch":
            data = torch.utils.data.TensorDataset(torch.randn(33, 1), torch.arange(33))
            loader = make_loader(data, 16, collate_fn=Batch, drop_last=False, **common)   # 33: a last batch of 1
        else:
            loader = make_loader(Numbers(96, how), 16, **common)
        try:
            next(iter(loader))
            read[how] = "read"
        except HetrainError as e:
            read[how] = str(e)
    return read


def test_what_the_ranks_must_read_alike_is_checked_at_the_first_batch():
    reads = run_ranks(_first_batches, 2)
    assert [r["same"] for r in reads] == ["read", "read"]
    # noise from each rank's own generator in samples of floats only: told from a split at a fresh start
    assert all("noise in samples of floats only" in r["float-noise"] for r in reads)
    for how in ("by-rank", "shuffle-buffer", "float-split"):   # 48 of 96 samples lost; 25 lost and 25 repeated
        messages = [r[how] for r in reads]
        assert all("streams gave different first global batches (rank 0; rank 1)" in m for m in messages), messages
        assert "split_by_node" in messages[0] and "shuffle" in messages[0] and "\n" not in messages[0]
    assert [r["object-never-cut"] for r in reads] == ["read", "read"]
    # a batch object: refused at the first step, not a TypeError at the end of the first epoch
    assert all("holds a Batch object" in r["object-batch"] and "dict, tuple, list" in r["object-batch"] for r in reads)


def test_values_of_the_whole_batch_are_kept_and_unknown_objects_refused_in_one_line():
    batch = {"x": torch.arange(4.0).view(4, 1), "names": ["a", "b", "c", "d"], "n": 5, "tag": "train"}
    first, second = slice_batch(batch, 0, 3, 4), slice_batch(batch, 3, 4, 4)
    assert first["names"] == ["a", "b", "c"] and second["x"].tolist() == [[3.0]] and second["n"] == 5
    empty = empty_batch({"x": torch.zeros(1, 2), "n": 5, "names": ["a"]})
    assert empty["x"].shape == (0, 2) and empty["n"] == 5 and empty["names"] == []
    check_cuttable(batch, 4)
    with pytest.raises(HetrainError, match="holds a Batch object"):
        check_cuttable({"b": Batch([(torch.zeros(1), 0)])}, 1)
    # one tensor or dict per sample (a detection collate, sequences of their own lengths): every micro-batch
    # got all 4 samples, and a sequence as long as the share was cut; refused in one line instead
    detection = (tuple(torch.zeros(3, 5, 5) for _ in range(4)), tuple({"boxes": torch.zeros(2, 4)} for _ in range(4)))
    sequences = {"tokens": [torch.zeros(3), torch.zeros(4), torch.zeros(2), torch.zeros(5)], "label": torch.zeros(4)}
    for per_sample in (detection, sequences):
        with pytest.raises(HetrainError, match="one .* per sample") as e:
            list(slice_batch(per_sample, 0, 2, 4))
        assert "\n" not in str(e.value)
    with pytest.raises(HetrainError, match="one dict per sample"):
        empty_batch(({"image": torch.zeros(1, 3)}, ({"boxes": torch.zeros(2, 4)},)))
    fields = (torch.zeros(4, 3), torch.zeros(4))   # the batch's own fields, as long as the share: cut
    assert [t.shape[0] for t in slice_batch(fields, 0, 2, 4)] == [2, 2]
    two_dicts = ({"x": torch.zeros(2, 3)}, {"y": torch.zeros(2)})   # the top level is fields, even 2 of 2
    first = slice_batch(two_dicts, 0, 1, 2)
    assert first[0]["x"].shape == (1, 3) and first[1]["y"].shape == (1,)
    assert slice_batch(["a", "b", "c", "d"], 0, 2, 4) == ["a", "b"]   # a dataset of strings collates to a list

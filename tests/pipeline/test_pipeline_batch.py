"""A replica's batch gathered from its ranks' slices: bytes for tensor batches, objects otherwise."""

import torch

from tests.distributed import run_ranks


def _slice(rank: int, n: int, tag: bool) -> tuple:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, 3, generator=g).half()            # 6 bytes a sample: the int64 labels start unaligned
    y = torch.randint(0, 9, (n,), generator=g)
    mask = torch.rand(n, 2, generator=g) > 0.5
    return (x, {"labels": y, "mask": mask}, f"rank{rank}") if tag else (x, {"labels": y, "mask": mask})


def gather(rank: int, world: int, counts: list[int], tag: bool):
    import torch.distributed as dist

    from hetrain.runtime.pipeline_batch import gather_replica_batch

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    got = gather_replica_batch(_slice(rank, counts[rank], tag), group, torch.device("cpu"))
    dist.destroy_process_group()
    return got


def test_tensor_batches_travel_as_bytes_in_rank_order():
    counts = [3, 0, 5]
    want = [_slice(r, n, False) for r, n in enumerate(counts)]
    for got in run_ranks(gather, 3, counts, False):
        assert torch.equal(got[0], torch.cat([w[0] for w in want]))
        for key in ("labels", "mask"):
            assert torch.equal(got[1][key], torch.cat([w[1][key] for w in want]))
            assert got[1][key].dtype == want[0][1][key].dtype


def test_other_batches_go_as_objects():
    counts = [2, 3]
    for got in run_ranks(gather, 2, counts, True):
        assert got[0].shape == (5, 3) and got[1]["labels"].shape == (5,)
        assert got[2] == "rank0"   # a non-tensor leaf: the first slice's


def gather_padded(rank: int, world: int):
    import torch.distributed as dist

    from hetrain.errors import HetrainError
    from hetrain.runtime.pipeline_batch import gather_replica_batch

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    ids = torch.ones(4, 11 if rank == 0 else 8, dtype=torch.int64)   # each slice padded to its own longest
    try:
        gather_replica_batch((ids, ids.clone()), group, torch.device("cpu"))
        error = None
    except HetrainError as e:
        error = str(e)
    dist.destroy_process_group()
    return error


def test_slices_padded_to_their_own_longest_are_refused_naming_a_fixed_length():
    """A collate padding to each batch's longest crashed every pipeline run with torch.cat's traceback."""
    for error in run_ranks(gather_padded, 2):
        assert error is not None and "collated their slices of its batch to different shapes (per sample [8] and " \
            "[11])" in error and "pad to one length for the whole step" in error, error

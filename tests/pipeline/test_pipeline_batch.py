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

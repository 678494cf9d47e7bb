"""Rank 0's weights reach every copy, in buckets that bound the memory a copy takes."""

import torch

from tests.distributed import run_ranks


def _copies(rank, world):
    import torch.distributed as dist

    import hetrain.runtime.replicas as replicas

    dist.init_process_group("gloo")
    replicas.BUCKET_BYTES = 64   # a few floats a bucket: many buckets, and tensors larger than one
    g = torch.Generator().manual_seed(rank)
    mine = [torch.randn(3, 4, generator=g).t(),            # not contiguous
            torch.randn(40, generator=g),                    # larger than a bucket: sent in slices
            torch.randn(8, 10, generator=g).t(),             # both
            torch.rand(5, generator=g) > 0.5,                # bool, which gloo does not carry
            torch.randint(0, 9, (6,), generator=g)]
    broadcast = [t.clone() for t in mine]
    replicas.copy_from(broadcast, src=0)
    sent = [t.clone() for t in mine]
    if rank == 0:
        replicas.send_to(sent, 1, torch.device("cpu"))
    else:
        replicas.receive_from(sent, 0, torch.device("cpu"))
    return mine, broadcast, sent


def test_every_copy_becomes_rank_0s_tensors_whatever_their_dtype_layout_and_size():
    (zero, _, _), (one, broadcast, sent) = run_ranks(_copies, 2)
    assert not torch.equal(zero[1], one[1])   # the ranks started apart
    for got in (broadcast, sent):
        for a, b in zip(zero, got):
            assert a.dtype == b.dtype and torch.equal(a, b)

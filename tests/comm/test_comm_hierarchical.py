"""Two-level all-reduce over declared islands gives the flat all-reduce's average."""

import torch
import torch.distributed as dist
import torch.nn as nn

from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import build_comm_hook
from tests.distributed import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))


def _grads(ddp: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(6 + rank, 32, generator=g), torch.randint(0, 5, (6 + rank,), generator=g)
    ddp.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    return torch.cat([p.grad.flatten() for p in ddp.module.parameters()])


def _two_level_vs_flat(rank: int, world: int, islands: list) -> dict:
    dist.init_process_group("gloo")
    flat = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    comm = CommPlan(hierarchical=True, islands=islands, bucket_cap_mb=0.01)
    two = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=comm.bucket_cap_mb)
    state, hook = build_comm_hook(comm)
    two.register_comm_hook(state, hook)
    diffs = [(_grads(two, rank, s) - _grads(flat, rank, s)).abs().max().item() for s in range(3)]
    return {"diffs": diffs, "levels": dict(state.stats.bytes_by_level), "leader": state.groups.is_leader,
            "numel": sum(p.numel() for p in flat.module.parameters())}


def test_two_islands_of_two_equal_the_flat_average():
    results = run_ranks(_two_level_vs_flat, 4, [[0, 1], [2, 3]])
    for r in results:
        assert max(r["diffs"]) < 1e-6
    # only leaders cross between islands, each sending a 2-rank all-reduce of the bucket per step
    assert [r["leader"] for r in results] == [True, False, True, False]
    assert "inter_island" not in results[1]["levels"]
    assert results[0]["levels"]["inter_island"] == 3 * results[0]["numel"] * 4
    assert results[1]["levels"]["intra_island"] == 3 * results[0]["numel"] * 4


def test_uneven_islands_equal_the_flat_average():
    for r in run_ranks(_two_level_vs_flat, 4, [[1, 3, 0], [2]]):
        assert max(r["diffs"]) < 1e-6

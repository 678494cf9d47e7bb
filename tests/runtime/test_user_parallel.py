"""A model the script parallelized itself: its gradients would be reduced twice (an update a fraction of the
right one, with no error), so it is refused in one line naming the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _parallelized(rank: int, world: int, how: str, sharding: str) -> str | None:
    import hetrain

    plan = Plan(global_batch_size=12, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8), RankPlan(rank=1, share=4)])
    with hetrain.Session(plan) as session:
        net = _net()
        try:
            if how == "replicate":   # torch's composable DDP, applied by the script
                from torch.distributed._composable.replicate import replicate
                replicate(net)
            elif how == "fully_shard_blocks":   # FSDP2 on the blocks, not the root
                from torch.distributed.fsdp import fully_shard
                fully_shard(net[0])
            elif how == "tensor_parallel":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
                mesh = init_device_mesh("cpu", (world,))
                parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
            if how == "ddp_around":   # a ported script's DDP(...) line kept after prepare()
                model = torch.nn.parallel.DistributedDataParallel(model)
            data = torch.utils.data.TensorDataset(torch.randn(24, 6), torch.randint(0, 3, (24,)))
            for x, y in session.loader(data, global_batch_size=12, shuffle=False):
                session.backward(F.cross_entropy(model(x), y))
                session.step()
        except HetrainError as e:
            return str(e)
    return None


@pytest.mark.parametrize("how, sharding, message", [
    ("ddp_around", "none", "wrapped in a DistributedDataParallel of the script's (or ran inside another "
                           "session's model's forward): its gradients would be averaged "
                           "over the ranks twice; use the returned model as it is"),
    ("ddp_around", "zero1", "wrapped in a DistributedDataParallel of the script's"),
    ("replicate", "none", "a model that went through replicate(): its gradients would be reduced twice; pass "
                          "the model before that call"),
    ("fully_shard_blocks", "none", "a model whose module '0' went through fully_shard()"),
    ("tensor_parallel", "none", "a model with DTensor parameters (0.weight, ...: tensor parallelism"),
])
def test_a_model_the_script_parallelized_itself_is_refused(how, sharding, message):
    """DDP around the returned model and replicate() before prepare() trained with exit status 0 and an update of
    1/world (0.5 of one process's on 2 ranks, 0.33 on 3) for every parameter behind the first; fully_shard() on a
    block and tensor parallelism gave torch's 'mixed torch.Tensor and DTensor' from inside DDP's set-up."""
    for error in run_ranks(_parallelized, 2, how, sharding):
        assert error is not None and message in error, error

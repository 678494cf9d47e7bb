"""Unequal shares, loss scaled by share*world/global: hooks return the global-batch gradient."""

import torch
import torch.distributed as dist
import torch.nn as nn

from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import build_comm_hook
from tests.distributed import run_ranks

SHARES = [3, 13]
GLOBAL = sum(SHARES)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(GLOBAL, 20, generator=g), torch.randint(0, 4, (GLOBAL,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 4))


def _weighted(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    x, y = _data()
    start = sum(SHARES[:rank])
    mine = slice(start, start + SHARES[rank])
    out = {}
    for compression in ("none", "fp16", "bf16"):
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(*build_comm_hook(CommPlan(compression=compression)))
        loss = nn.functional.cross_entropy(ddp(x[mine]), y[mine]) * SHARES[rank] * world / GLOBAL
        loss.backward()
        out[compression] = torch.cat([p.grad.flatten() for p in model.parameters()])
    return out


def test_weighted_gradients_stay_exact_to_the_precision_sent():
    model = _model()
    x, y = _data()
    nn.functional.cross_entropy(model(x), y).backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()])
    scale = reference.abs().max()
    for r in run_ranks(_weighted, 2):
        assert (r["none"] - reference).abs().max() <= 1e-6 * scale
        assert (r["fp16"] - reference).abs().max() <= 2 ** -10 * scale  # fp16: 10 mantissa bits
        assert (r["bf16"] - reference).abs().max() <= 2 ** -7 * scale  # bf16: 7 mantissa bits
        assert not torch.equal(r["bf16"], r["none"])  # it did travel in bf16

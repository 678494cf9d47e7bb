"""torch's PowerSGD through hetrain's wrapper: exact during warm-up, compressed after, bytes counted."""

import torch
import torch.distributed as dist
import torch.nn as nn

from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import build_comm_hook
from tests.distributed import run_ranks

WARMUP = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 32))


def _steps(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    plain = nn.parallel.DistributedDataParallel(_model())
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state, hook = build_comm_hook(CommPlan(compression="powersgd", powersgd_rank=2, powersgd_warmup_steps=WARMUP))
    ddp.register_comm_hook(state, hook)
    diffs, sent = [], []
    for step in range(WARMUP + 2):
        x = torch.randn(8, 48, generator=torch.Generator().manual_seed(10 * step + rank))
        grads = []
        for net in (plain, ddp):
            net.zero_grad()
            net(x).square().mean().backward()
            grads.append(torch.cat([p.grad.flatten() for p in net.module.parameters()]))
        diffs.append(((grads[1] - grads[0]).norm() / grads[0].norm()).item())
        sent.append(state.stats.bytes_sent)
    per_step = [b - a for a, b in zip([0.0] + sent[:-1], sent)]
    return {"diffs": diffs, "per_step": per_step, "error_buckets": len(state.inner.error_dict),
            "iter": state.inner.iter}


def test_powersgd_is_exact_in_warmup_then_sends_p_and_q():
    numel = 48 * 64 + 64 + 64 * 32 + 32
    compressed = (64 + 48) * 2 + 64 + (32 + 64) * 2 + 32  # P and Q of each matrix, biases as they are
    for r in run_ranks(_steps, 2):
        assert max(r["diffs"][:WARMUP]) < 1e-6
        assert min(r["diffs"][WARMUP:]) > 1e-3  # a rank-2 approximation, not the full gradient
        assert r["per_step"] == [numel * 4.0] * WARMUP + [compressed * 4.0] * 2
        assert r["error_buckets"] == 1 and r["iter"] == WARMUP + 2

"""Each hook's bytes per step, counted inside DDP, against the ring formula from the model's shapes."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import build_comm_hook, ddp_kwargs
from tests.distributed import run_ranks

SHAPES = [(96, 40), (96,), (64, 96), (64,), (10, 64), (10,)]
STEPS = 4
WARMUP = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 96), nn.ReLU(), nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 10))


def _bytes_per_step(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    out = {}
    for compression in ["none", "fp16", "bf16", "powersgd", "int8", "topk"]:
        comm = CommPlan(compression=compression, powersgd_rank=2, powersgd_warmup_steps=WARMUP, topk_ratio=0.01)
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs(comm))  # 25 MB: one bucket
        state, hook = build_comm_hook(comm)
        ddp.register_comm_hook(state, hook)
        per_step = []
        for step in range(STEPS):
            before = state.stats.bytes_sent
            x = torch.randn(8, 40, generator=torch.Generator().manual_seed(step * 10 + rank))
            ddp(x).square().mean().backward()
            per_step.append(state.stats.bytes_sent - before)
        out[compression] = (per_step, state.stats.steps, state.stats.bytes_per_step())
    return out


def _expected(compression: str, n: int, step: int) -> float:
    numel = sum(math.prod(s) for s in SHAPES)
    ring = 2 * (n - 1) / n
    if compression == "none":
        return ring * 4 * numel
    if compression in ("fp16", "bf16"):
        return ring * 2 * numel
    if compression == "powersgd":
        if step < WARMUP:
            return ring * 4 * numel
        elems = 0
        for s in SHAPES:
            rows, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
            r = min(rows, cols, 2)
            elems += (rows + cols) * r if (rows + cols) * r * 2 < rows * cols else rows * cols
        return ring * 4 * elems
    if compression == "int8":
        shard = math.ceil(numel / n)
        return 2 * (n - 1) * (shard + 4 * math.ceil(shard / 512))
    if compression == "topk":
        return (n - 1) * 8 * math.ceil(0.01 * numel)
    raise AssertionError(compression)


def test_bytes_per_step_match_the_ring_formula_on_two_ranks():
    results = run_ranks(_bytes_per_step, 2)
    for rank_result in results:
        for compression, (per_step, steps, mean) in rank_result.items():
            expected = [_expected(compression, 2, s) for s in range(STEPS)]
            assert per_step == expected, compression
            assert steps == STEPS
            assert mean == sum(expected) / STEPS
    # the targets on 2 ranks hold even for this small model
    none = results[0]["none"][2]
    assert results[0]["int8"][2] / none <= 0.27
    assert results[0]["topk"][2] / none <= 0.03

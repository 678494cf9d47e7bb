"""The job `hetrain bench pipeline` launches: one rank per emulated speed, three plans in one run.

Each block computes a small residual layer and then waits `block_ms * samples / speed`
milliseconds in forward and twice that in backward, so a rank at speed 0.5 takes twice as long
per block as one at speed 1 (emulated compute: the figures say so). The layer's own compute is
slowed by the same factor (a wait of `(1/speed - 1)` times its measured time, forward and
backward), as a slower device would: otherwise the slow ranks' real compute would run at full
speed and favour partitions that give them more blocks. The same script runs every
plan through `session.forward_backward`: the planner's uneven partition, an even partition, and
data parallelism with shares by speed. Rank 0 writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from hetrain.runtime.environment import collect_at_exit
from hetrain.runtime.timing import EMULATION_CLOCK

WIDTH = 16
SPEED = [1.0]       # this rank's emulated speed
BUSY = [0.0]        # seconds this rank spent computing (emulated) in the current step


def _wait(seconds: float) -> None:
    """Wait `seconds` of emulated compute on the benchmarks' drift-free clock, counted as busy."""
    BUSY[0] += EMULATION_CLOCK.wait(seconds)


def _slowed(real: float) -> None:
    """Count `real` seconds of the layer's own compute, and wait so it takes 1/speed as long."""
    BUSY[0] += real
    _wait(real * (1.0 / SPEED[0] - 1.0))


class _Start(torch.autograd.Function):
    """Identity at a block's input; in backward (the block's last node) it slows the layer's backward
    compute that ran since `_Emulated`'s backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: list) -> torch.Tensor:  # type: ignore[override]
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        _slowed(time.perf_counter() - ctx.clock[0])
        return grad, None


class _Emulated(torch.autograd.Function):
    """Identity at a block's output that takes `seconds` in forward and twice that in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float, clock: list) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds, ctx.clock = seconds, clock
        _wait(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        _wait(2.0 * ctx.seconds)
        ctx.clock[0] = time.perf_counter()   # the layer's backward starts now
        return grad, None, None


class Block(nn.Module):
    def __init__(self, block_ms: float) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.seconds_per_sample = block_ms / 1000.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock = [0.0]
        started = time.perf_counter()
        if not x.requires_grad:   # the model's input: let `_Start` see the layer's backward all the same
            x = x.detach().requires_grad_()
        x = _Start.apply(x, clock)
        x = x + torch.tanh(self.fc(x))
        _slowed(time.perf_counter() - started)
        return _Emulated.apply(x, self.seconds_per_sample * x.shape[0] / SPEED[0], clock)


def make_model(blocks: int, block_ms: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(block_ms) for _ in range(blocks)])


def run_plan(plan, args: argparse.Namespace) -> dict:
    """Steps of one plan: the median step time (slowest rank), and per rank the median emulated busy
    time and the median time of `forward_backward` (the pipeline schedule's run)."""
    import hetrain

    session = hetrain.Session(plan)
    net = make_model(args.blocks, args.block_ms)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    n = args.global_batch * (args.steps + 1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
    loader = session.loader(data, global_batch_size=args.global_batch, shuffle=False)
    steps, busy, passes = [], [], []
    dist.barrier()
    last = time.perf_counter()
    for x, y in loader:
        BUSY[0] = 0.0
        started = time.perf_counter()
        session.forward_backward(x, y, F.mse_loss)
        passes.append(time.perf_counter() - started)
        session.step()
        now = time.perf_counter()
        steps.append(now - last)
        busy.append(BUSY[0])
        last = now
        if session.step_count == args.steps:
            break
    session.close()
    timed = slice(args.warmup, None)
    mine = torch.tensor([statistics.median(steps[timed]), statistics.median(busy[timed]),
                         statistics.median(passes[timed])], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"step_seconds": max(float(t[0]) for t in every), "busy_seconds": [float(t[1]) for t in every],
            "pass_seconds": [float(t[2]) for t in every]}


def main(argv: list[str] | None = None) -> None:
    from hetrain.bench.pipeline import plans

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="the benchmark's settings as JSON")
    parser.add_argument("--out", required=True)
    cli = parser.parse_args(argv)
    args = argparse.Namespace(**json.loads(cli.config))
    dist.init_process_group("gloo")
    collect_at_exit()   # at exit: collect, and let gloo's workers free their last tensors (settle_at_exit)
    torch.set_num_threads(1)
    SPEED[0] = args.speeds[dist.get_rank()]
    results = {name: run_plan(plan, args) for name, plan in plans(args).items()}
    if dist.get_rank() == 0:
        Path(cli.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

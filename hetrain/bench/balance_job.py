"""The worker of `hetrain demo` and `hetrain bench balance` (run under `hetrain launch -m`).

Three phases in one process group, on the same global batches and the same initial weights:
1. solo: each rank trains alone on whole global batches, no communication; the sum of these
   rates is the ideal for the job;
2. uniform: plain DistributedDataParallel with an even split, as frameworks do today;
3. balanced: hetrain's Session, whose balancer re-splits by measured speed.
The emulated speed pads every rank's compute the same way in all three phases (it stands for the
device, not the framework). Rank 0 writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hetrain.bench.digits import accuracy, digits_datasets, digits_mlp
from hetrain.planning.plan import Plan
from hetrain.runtime.data import GlobalBatchOrder, rank_slice
from hetrain.runtime.timing import StepTimer, TimedHookState, emulated_speed, pad_to_speed, timed_hook


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--interval", type=int, default=5, help="balancer interval (steps)")
    p.add_argument("--warmup", type=int, default=10, help="steps not timed (balancer settling, allocation)")
    p.add_argument("--solo-steps", type=int, default=4)
    p.add_argument("--phases", default="solo,uniform,balanced")
    p.add_argument("--out", required=True)
    p.add_argument("--progress", action="store_true")
    return p.parse_args(argv)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD with momentum: the same optimizer, from the same weights, in every phase."""
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


class _Progress:
    """A rich progress bar on rank 0 (stderr), nothing elsewhere."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            from rich.console import Console

            self.bar = Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self.bar.start()
        self.task = None

    def phase(self, name: str, total: int) -> None:
        if self.bar is not None:
            self.task = self.bar.add_task(name, total=total)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _timed_wall(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def solo_phase(args, train, speed, progress) -> float:
    """This rank's own rate (samples/s) training whole global batches, no communication."""
    model = digits_mlp(args.hidden)
    opt = make_optimizer(model, args)
    x, y = train.tensors
    order = GlobalBatchOrder(len(train), args.global_batch, seed=0)
    times = []
    progress.phase("solo rates", args.solo_steps + 1)
    for step in range(args.solo_steps + 1):
        idx = order.global_batch(0, step % order.steps_per_epoch)
        t0 = time.perf_counter()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        compute = pad_to_speed(time.perf_counter() - t0, speed)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        compute += pad_to_speed(time.perf_counter() - t1, speed)
        if step > 0:  # the first step pays for allocation
            times.append(compute)
        progress.advance()
    return args.global_batch * len(times) / sum(times)


def uniform_phase(args, train, test, speed, progress) -> dict:
    """Plain DDP, even split of each global batch; the device's speed is emulated, nothing else."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = digits_mlp(args.hidden)
    opt = make_optimizer(model, args)
    ddp = DistributedDataParallel(model)
    timer = StepTimer(speed=speed)
    ddp.register_comm_hook(TimedHookState(timer, None, default_hooks.allreduce_hook), timed_hook)
    ddp.register_forward_pre_hook(timer.forward_pre_hook)
    shares = Plan.even(world, args.global_batch).shares
    x, y = train.tensors
    order = GlobalBatchOrder(len(train), args.global_batch, seed=0)
    compute = []

    def run_steps(first: int, last: int) -> None:
        for step in range(first, last):
            epoch, s = divmod(step, order.steps_per_epoch)
            idx = rank_slice(order.global_batch(epoch, s), shares, rank)
            loss = F.cross_entropy(ddp(x[idx]), y[idx])
            loss.backward()
            timer.time_optimizer(opt.step)
            opt.zero_grad(set_to_none=True)
            c = timer.end_step()
            if step >= args.warmup:
                compute.append(c)
            progress.advance()

    progress.phase("plain DDP, even split", args.steps)
    run_steps(0, args.warmup)
    wall = _timed_wall(lambda: run_steps(args.warmup, args.steps))
    measured = args.steps - args.warmup
    return {"samples_per_s": args.global_batch * measured / wall, "shares": shares,
            "idle_fraction": max(0.0, 1 - sum(compute) / wall), "test_accuracy": accuracy(model, test),
            "train_loss": train_loss(model, train), "step_seconds": wall / measured}


def balanced_phase(args, train, test, progress) -> dict:
    """hetrain: the Session's weighted backward and its balancer."""
    import hetrain

    session = hetrain.Session(balance=True, balance_interval=args.interval)
    model = digits_mlp(args.hidden)
    ddp, opt = session.prepare(model, make_optimizer(model, args))
    loader = session.loader(train, global_batch_size=args.global_batch, shuffle=True, seed=0)
    compute_start = [0]
    batches = iter(())

    def run_steps(first: int, last: int) -> None:
        nonlocal batches
        for step in range(first, last):
            try:
                xb, yb = next(batches)
            except StopIteration:
                batches = iter(loader)
                xb, yb = next(batches)
            loss = F.cross_entropy(ddp(xb), yb)
            session.backward(loss)
            session.step()
            progress.advance()

    progress.phase("hetrain, balanced", args.steps)
    run_steps(0, args.warmup)
    compute_start[0] = len(session.compute_seconds)
    t_wall = _timed_wall(lambda: run_steps(args.warmup, args.steps))
    measured = args.steps - args.warmup
    compute = sum(session.compute_seconds[compute_start[0]:])
    changes = [{"step": c.step, "old": c.old, "new": c.new} for c in session.balancer.changes]
    return {"samples_per_s": args.global_batch * measured / t_wall, "shares": list(session.shares),
            "idle_fraction": max(0.0, 1 - compute / t_wall), "test_accuracy": accuracy(model, test),
            "train_loss": train_loss(model, train),
            "step_seconds": t_wall / measured, "split_changes": changes}


@torch.no_grad()
def train_loss(model: torch.nn.Module, train) -> float:
    x, y = train.tensors
    return float(F.cross_entropy(model(x), y))


def gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.warmup >= args.steps:
        print(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    speed = emulated_speed(rank, world)
    train, test = digits_datasets()
    phases = args.phases.split(",")
    progress = _Progress(args.progress and rank == 0, 0)
    result: dict = {"world_size": world, "global_batch_size": args.global_batch, "steps": args.steps,
                    "timed_steps": args.steps - args.warmup, "emulated": speed is not None,
                    "speeds": gather(speed if speed is not None else 1.0)}
    try:
        if "solo" in phases:
            result["solo_samples_per_s"] = gather(solo_phase(args, train, speed, progress))
        for name in ("uniform", "balanced"):
            if name not in phases:
                continue
            res = uniform_phase(args, train, test, speed, progress) if name == "uniform" \
                else balanced_phase(args, train, test, progress)
            idle = gather(res.pop("idle_fraction"))
            # throughput by rank 0's clock, which every rank's barrier bounds
            res["idle_fraction"] = idle
            result[name] = res
    finally:
        progress.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

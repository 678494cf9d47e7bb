"""The worker of `hetrain demo` and `hetrain bench balance` (run under `hetrain launch -m`).

Three modes in one process group, on the same global batches and the same initial weights:
- solo: each rank trains alone on its current balanced share, no communication; the sum of these
  rates is the ideal for the job;
- uniform: plain DistributedDataParallel with an even split, as frameworks do today;
- balanced: hetrain's Session, whose balancer re-splits by measured speed.
The demo runs them one after the other; the benchmark alternates short timed blocks of each, so a
drift of this shared machine's speed falls on every mode alike, and takes each mode's rate as the
median over its blocks, so a burst of outside load does not decide it. The emulated speed pads every
rank's compute the same way in all modes (it stands for the device, not the framework). Rank 0
writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hetrain.bench.digits import accuracy, digits_datasets, digits_model
from hetrain.planning.plan import Plan
from hetrain.runtime.data import GlobalBatchOrder, rank_slice
from hetrain.runtime.environment import collect_at_exit
from hetrain.runtime.timing import StepTimer, TimedHookState, emulated_speed, pad_to_speed, timed_hook


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=int, default=512)
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--hidden", type=int, default=64, help="CNN channels or MLP width")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--interval", type=int, default=5, help="balancer interval (steps)")
    p.add_argument("--warmup", type=int, default=10, help="steps not timed (balancer settling, allocation)")
    p.add_argument("--solo-steps", type=int, default=30)
    p.add_argument("--phases", default="solo,uniform,balanced")
    p.add_argument("--schedule", choices=["sequential", "interleaved"], default="sequential")
    p.add_argument("--block", type=int, default=3, help="steps per block when interleaved")
    p.add_argument("--out", required=True)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--metrics-port", type=int, default=None, help="base port of the metrics phase")
    p.add_argument("--outside-load", type=int, default=None, metavar="SEED",
                   help="pin ranks one per core and run seeded bursts of outside load on rank 0's core")
    return p.parse_args(argv)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD with momentum: the same optimizer, from the same weights, in every phase."""
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


class _Progress:
    """A rich progress bar on rank 0 (stderr), nothing elsewhere."""

    def __init__(self, enabled: bool) -> None:
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

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class SoloRunner:
    """This rank alone, no communication, on as many samples as its current balanced share: its
    own rate at the work it does, for the ideal (on CPU the time per sample grows with the batch,
    so a rate taken on the whole global batch would understate it)."""

    name = "solo"

    def __init__(self, args, train, speed) -> None:
        self.args, self.speed = args, speed
        self.model = digits_model(args.model, args.hidden)
        self.opt = make_optimizer(self.model, args)
        self.x, self.y = train.tensors
        self.order = GlobalBatchOrder(len(train), args.global_batch, seed=0)
        self.steps = 0
        self.timed_samples = 0
        self.timed_seconds = 0.0
        self.block_rates: list[float] = []   # samples/s of each timed block of steps

    def step(self, samples: int) -> tuple[int, float]:
        """One step on ``samples`` samples; returns (samples, compute seconds, emulation included)."""
        epoch, s = divmod(self.steps, self.order.steps_per_epoch)
        idx = self.order.global_batch(epoch, s)[:max(samples, 1)]
        t0 = time.perf_counter()
        F.cross_entropy(self.model(self.x[idx]), self.y[idx]).backward()
        compute = pad_to_speed(time.perf_counter() - t0, self.speed)
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        compute += pad_to_speed(time.perf_counter() - t1, self.speed)
        self.steps += 1
        return len(idx), compute

    def block(self, steps: int, samples: int, timed: bool = True) -> None:
        """``steps`` steps, timed as one block like the other modes' blocks."""
        n, seconds = 0, 0.0
        for _ in range(steps):
            k, c = self.step(samples)
            n, seconds = n + k, seconds + c
        if timed:
            self.timed_samples += n
            self.timed_seconds += seconds
            self.block_rates.append(n / seconds)

    def samples_per_s(self) -> float:
        """The median over blocks, as for the other modes: a burst of outside load does not decide it."""
        return statistics.median(self.block_rates)

    def mean_samples_per_s(self) -> float:
        return self.timed_samples / self.timed_seconds


class UniformRunner:
    """Plain DDP, even split of each global batch; the device's speed is emulated, nothing else."""

    name = "uniform"
    hooked = True   # the comm hook that times compute and emulates the speed

    def __init__(self, args, train, speed) -> None:
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.model = digits_model(args.model, args.hidden)
        self.opt = make_optimizer(self.model, args)
        self.ddp = DistributedDataParallel(self.model)
        self.timer = StepTimer(speed=speed) if self.hooked else None
        if self.timer is not None:
            self.ddp.register_comm_hook(TimedHookState(self.timer, None, default_hooks.allreduce_hook), timed_hook)
            self.timer.attach_ddp(self.ddp)
        self.shares = Plan.even(world, args.global_batch).shares
        self.x, self.y = train.tensors
        self.order = GlobalBatchOrder(len(train), args.global_batch, seed=0)
        self.steps = 0
        self.last_compute = 0.0

    def step(self) -> None:
        epoch, s = divmod(self.steps, self.order.steps_per_epoch)
        idx = rank_slice(self.order.global_batch(epoch, s), self.shares, self.rank)
        F.cross_entropy(self.ddp(self.x[idx]), self.y[idx]).backward()
        if self.timer is None:
            self.opt.step()
        else:
            self.timer.time_optimizer(self.opt.step)
        self.opt.zero_grad(set_to_none=True)
        self.last_compute = self.timer.end_step() if self.timer is not None else 0.0
        self.steps += 1

    def current_shares(self) -> list[int]:
        return list(self.shares)

    def extra(self) -> dict:
        return {}


class PlainDDPRunner(UniformRunner):
    """DDP as a script builds it, without the timing hook (speeds 1,1 only: nothing to emulate): what the
    Session's own per-step cost is held against. Its compute is not timed."""

    name = "ddp"
    hooked = False


class BalancedRunner:
    """hetrain: the Session's weighted backward and its balancer."""

    name = "balanced"

    def __init__(self, args, train, speed) -> None:
        import hetrain

        self.session = hetrain.Session(balance=True, balance_interval=args.interval)
        self.model = digits_model(args.model, args.hidden)
        self.ddp, self.opt = self.session.prepare(self.model, make_optimizer(self.model, args))
        self.loader = self.session.loader(train, global_batch_size=args.global_batch, shuffle=True, seed=0)
        self.batches = iter(())
        self.steps = 0
        self.last_compute = 0.0

    def step(self) -> None:
        try:
            xb, yb = next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            xb, yb = next(self.batches)
        self.session.backward(F.cross_entropy(self.ddp(xb), yb))
        self.session.step()
        self.last_compute = self.session.compute_seconds[-1] if self.session.compute_seconds else 0.0
        self.steps += 1

    def current_shares(self) -> list[int]:
        return list(self.session.shares)

    def extra(self) -> dict:
        compute = sorted(self.session.compute_seconds) or [0.0]
        return {"split_changes": [{"step": c.step, "old": c.old, "new": c.new}
                                  for c in self.session.balancer.changes],
                "compute_ms_median_p90": gather([round(1e3 * compute[len(compute) // 2], 2),
                                                 round(1e3 * compute[(9 * len(compute)) // 10], 2)])}


class MetricsRunner:
    """hetrain with its Prometheus metrics on: the balanced runner's session, with the metrics
    observer attached for these steps only (so on and off run on the same split and weights)."""

    name = "metrics"

    def __init__(self, balanced: BalancedRunner, port: int) -> None:
        s = balanced.session
        s.reports.start_metrics(port=port, rank=s.rank, local_rank=s.local_rank, world_size=s.world_size,
                                device=s.device, device_name=s.entry.device, job="bench-balance",
                                predicted_step_seconds=None, restart_count=0, module=s.prepared.module)
        self.metrics = s.reports.observers.pop()
        self.balanced, self.model = balanced, balanced.model
        self.last_compute = 0.0

    def step(self) -> None:
        observers = self.balanced.session.reports.observers
        observers.append(self.metrics)
        try:
            self.balanced.step()
        finally:
            observers.remove(self.metrics)
        self.last_compute = self.balanced.last_compute

    def current_shares(self) -> list[int]:
        return self.balanced.current_shares()

    def extra(self) -> dict:
        return {}


class Timed:
    """Wall and compute seconds of the timed steps of one mode.

    A block starts when every rank leaves a barrier and ends when the last rank finishes its last
    step: each rank times its own steps and the block takes the longest. The barrier that closes a
    block is the benchmark's, not the training loop's (a loop does not stop every few steps), so it
    is not in the time; each step's own waiting for the others is."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.compute = 0.0
        self.steps = 0
        self.block_rates: list[float] = []   # samples/s of each timed block

    def block(self, runner, steps: int, timed: bool, progress) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        compute = 0.0
        for _ in range(steps):
            runner.step()
            compute += runner.last_compute
            progress.advance()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # also the block's closing barrier
        if timed:
            wall = float(elapsed)
            self.wall += wall
            self.compute += compute
            self.steps += steps
            self.block_rates.append(steps / wall)


def run_schedule(args, runners: dict, solo: SoloRunner | None, progress) -> dict[str, Timed]:
    rank = dist.get_rank()

    def share() -> int:  # this rank's current balanced share (even split without a balanced mode)
        shares = runners["balanced"].current_shares() if "balanced" in runners else \
            Plan.even(dist.get_world_size(), args.global_batch).shares
        return shares[rank]

    """Untimed warm-up of each mode, then the timed steps: all of one mode after the other
    (sequential), or alternating blocks of each mode (interleaved, so drift of the machine's speed
    falls on every mode alike). Solo blocks have the same length as the others' and are spread
    evenly over the rounds."""
    timed = {name: Timed() for name in runners}
    measured = args.steps - args.warmup
    if args.schedule == "sequential":
        for name, runner in runners.items():
            progress.phase(LABELS[name], args.steps)
            timed[name].block(runner, args.warmup, False, progress)
            timed[name].block(runner, measured, True, progress)
        if solo is not None:  # last: on the shares the balancer arrived at
            steps = min(args.solo_steps, 10)
            progress.phase("solo rates", steps + 1)
            solo.block(1, share(), timed=False)   # the first step pays for allocation
            solo.block(steps, share())
            progress.advance(steps + 1)
        return timed
    progress.phase("warm-up", args.warmup * len(runners) + (1 if solo else 0))
    for name, runner in runners.items():
        timed[name].block(runner, args.warmup, False, progress)
    if solo is not None:
        solo.block(1, share(), timed=False)
        progress.advance()
    rounds = -(-measured // args.block)
    solo_blocks = max(1, -(-args.solo_steps // args.block)) if solo is not None else 0
    solo_rounds = {round(i * rounds / solo_blocks) for i in range(solo_blocks)}
    progress.phase("interleaved, timed", measured * len(runners) + len(solo_rounds) * args.block)
    done = 0
    for r in range(rounds):
        k = min(args.block, measured - done)
        for name, runner in runners.items():
            timed[name].block(runner, k, True, progress)
        if r in solo_rounds:
            solo.block(args.block, share())
            progress.advance(args.block)
        done += k
    return timed


LABELS = {"uniform": "plain DDP, even split", "balanced": "hetrain, balanced", "metrics": "hetrain, metrics on",
          "ddp": "DDP without hooks"}


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
    collect_at_exit()   # at exit: collect, and let gloo's workers free their last tensors (settle_at_exit)
    rank, world = dist.get_rank(), dist.get_world_size()
    speed = emulated_speed(rank, world)
    train, test = digits_datasets()
    phases = args.phases.split(",")
    progress = _Progress(args.progress and rank == 0)
    result: dict = {"world_size": world, "global_batch_size": args.global_batch, "steps": args.steps,
                    "timed_steps": args.steps - args.warmup, "emulated": speed is not None,
                    "speeds": gather(speed if speed is not None else 1.0)}
    load = None
    if args.outside_load is not None:
        from hetrain.bench.outside_load import OutsideLoad, pin_to_core

        result["pinned"] = gather(pin_to_core(rank))
        if rank == 0:
            load = OutsideLoad(core=0, seed=args.outside_load).start()
    try:
        solo = SoloRunner(args, train, speed) if "solo" in phases else None
        kinds = {"uniform": UniformRunner, "balanced": BalancedRunner, "ddp": PlainDDPRunner}
        runners = {name: kinds[name](args, train, speed) for name in ("uniform", "balanced", "ddp") if name in phases}
        if "metrics" in phases:
            runners["metrics"] = MetricsRunner(runners["balanced"], args.metrics_port)
        timed = run_schedule(args, runners, solo, progress)
        if solo is not None:
            result["solo_samples_per_s"] = gather(solo.samples_per_s())
            result["solo_mean_samples_per_s"] = gather(solo.mean_samples_per_s())
        for name, runner in runners.items():
            t = timed[name]
            result[name] = {
                # median over blocks (one block when sequential); the mean over all steps beside it
                "samples_per_s": args.global_batch * statistics.median(t.block_rates),
                "mean_samples_per_s": args.global_batch * t.steps / t.wall,
                "shares": runner.current_shares(),
                "idle_fraction": gather(max(0.0, 1 - t.compute / t.wall)) if name != "ddp" else None,
                "test_accuracy": accuracy(runner.model, test),
                "train_loss": train_loss(runner.model, train),
                "step_seconds": t.wall / t.steps,
                **runner.extra(),
            }
    finally:
        progress.close()
        if load is not None:
            load.stop()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:   # Ctrl-C in the terminal reaches every rank: the launcher says it, once
        sys.exit(130)

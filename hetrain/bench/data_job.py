"""The worker of `hetrain bench data` (run under `hetrain launch -m`): reading real images with workers.

A map-style dataset whose `__getitem__` decodes a JPEG (PIL, from bytes in memory) and a small CNN.
Phases, one after the other in one process group, each timed between barriers after its warm-up:
- plain DDP: `DistributedSampler` + `DataLoader(num_workers=W)`, even split, at speeds 1,1 and 1,0.5;
- hetrain: `session.loader(..., num_workers=W)`, balanced, at the same speeds;
- one rank's input pipeline slowed (fewer workers), speeds 1,1: hetrain with an even split, and balanced.
Speeds are emulated as in every hetrain benchmark (a rank at speed s pads its compute to 1/s).
Rank 0 writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hetrain.runtime.timing import StepTimer, TimedHookState, timed_hook
from hetrain.vocabulary import Env


class JpegImages(Dataset):
    """``n`` JPEG images made in memory (smooth colour fields with noise, so decoding has real work);
    `__getitem__` decodes one with PIL, resizes it and returns (3 x size x size float tensor, label)."""

    def __init__(self, n: int = 512, source: int = 160, size: int = 32, seed: int = 0, distinct: int = 64) -> None:
        from PIL import Image

        g = torch.Generator().manual_seed(seed)
        self.size = size
        self.n = n
        self.images: list[bytes] = []   # `distinct` encoded images; sample i decodes image i % distinct
        self.labels = torch.randint(0, 10, (n,), generator=g)
        ramp = torch.linspace(0, 1, source)
        for _ in range(min(n, distinct)):
            base = torch.rand(3, 1, 1, generator=g) * ramp.view(1, -1, 1) + torch.rand(3, 1, 1, generator=g) * ramp
            pixels = (255 * (0.7 * base + 0.3 * torch.rand(3, source, source, generator=g))).clamp(0, 255)
            image = Image.fromarray(pixels.to(torch.uint8).permute(1, 2, 0).numpy())
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=90)
            self.images.append(buf.getvalue())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        image = Image.open(io.BytesIO(self.images[i % len(self.images)])).convert("RGB").resize((self.size, self.size), Image.BILINEAR)
        x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(self.size, self.size, 3)
        return x.permute(2, 0, 1).float().div_(255), self.labels[i]


def small_cnn(width: int = 16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(width, 2 * width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(2 * width * 64, 10))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slow-workers", type=int, default=0, help="workers of the slowed rank's loader")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=30, help="steps per phase not timed (the balancer settles)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _cycle(make_iter):
    while True:
        yield from make_iter()


def plain_ddp(args, data, speed: float | None) -> dict:
    """Plain DDP: DistributedSampler + DataLoader with the same workers, even split."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = small_cnn(args.width)
    ddp = DistributedDataParallel(model)
    timer = StepTimer(speed=speed)
    ddp.register_comm_hook(TimedHookState(timer, None, default_hooks.allreduce_hook), timed_hook)
    ddp.register_forward_pre_hook(timer.forward_pre_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, num_workers=args.workers,
                        drop_last=True, persistent_workers=args.workers > 0)
    epoch = [0]

    def epoch_iter():
        sampler.set_epoch(epoch[0])
        epoch[0] += 1
        return iter(loader)

    batches = _cycle(epoch_iter)

    def step() -> None:
        x, y = next(batches)
        F.cross_entropy(ddp(x), y).backward()
        timer.time_optimizer(opt.step)
        opt.zero_grad(set_to_none=True)
        timer.end_step()

    return _timed(args, step, shares=[args.global_batch // world] * world)


def hetrain_loader(args, data, slow: float | None, *, balance: bool, workers: int) -> dict:
    """hetrain's Session and loader with `workers` workers on this rank; rank 1 at speed `slow`."""
    import hetrain

    if slow is None:
        os.environ.pop(Env.EMULATE_SPEEDS, None)
    else:
        os.environ[Env.EMULATE_SPEEDS] = _speeds(slow)
    session = hetrain.Session(balance=balance, balance_interval=args.interval)
    model = small_cnn(args.width)
    ddp, opt = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loader = session.loader(data, global_batch_size=args.global_batch, shuffle=True, seed=0, num_workers=workers,
                            persistent_workers=workers > 0)
    batches = _cycle(lambda: iter(loader))
    waits: list[float] = []

    def step() -> None:
        x, y = next(batches)
        waits.append(loader.data_wait_seconds)
        session.backward(F.cross_entropy(ddp(x), y))
        session.step()

    out = _timed(args, step, shares=lambda: list(session.shares))
    out["split_changes"] = [{"step": c.step, "new": c.new} for c in session.balancer.changes]
    timed = waits[-args.steps:]
    out["data_wait_ms_per_step"] = _gather(1e3 * sum(timed) / len(timed))
    session.close()
    return out


def _speeds(slow: float) -> str:
    """This job's speed per rank: rank 1 at `slow`, the others at 1."""
    return ",".join("1" if r != 1 else str(slow) for r in range(dist.get_world_size()))


def _gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _timed(args, step, shares) -> dict:
    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    wall = time.perf_counter() - t0
    return {"samples_per_s": args.global_batch * args.steps / wall,
            "shares": shares() if callable(shares) else shares}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = JpegImages(args.samples)
    t0 = time.perf_counter()
    for i in range(32):
        data[i]
    decode_ms = 1e3 * (time.perf_counter() - t0) / 32
    slow = 0.5
    result: dict = {"world_size": dist.get_world_size(), "global_batch_size": args.global_batch,
                    "workers": args.workers, "slow_workers": args.slow_workers, "timed_steps": args.steps,
                    "decode_ms_per_sample": _gather(decode_ms)}
    result["ddp_1_1"] = plain_ddp(args, data, None)
    result["hetrain_1_1"] = hetrain_loader(args, data, None, balance=True, workers=args.workers)
    result["ddp_1_0.5"] = plain_ddp(args, data, slow if rank == 1 else None)
    result["hetrain_1_0.5"] = hetrain_loader(args, data, slow, balance=True, workers=args.workers)
    fewer = args.slow_workers if rank == 1 else args.workers
    result["slow_loader_even"] = hetrain_loader(args, data, None, balance=False, workers=fewer)
    result["slow_loader_hetrain"] = hetrain_loader(args, data, None, balance=True, workers=fewer)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The worker of `hetrain bench data` (run under `hetrain launch -m`): reading real images with workers.

A map-style dataset whose `__getitem__` decodes a JPEG (PIL, from bytes in memory) and a small CNN.
Three comparisons in one process group; in each, both modes are warmed up, then timed in
alternating blocks of steps between barriers (a drift of the machine's speed falls on both alike),
and each rate is the median over its blocks:
- speeds 1,1: plain DDP (`DistributedSampler` + `DataLoader(num_workers=W)`, even split) and
  hetrain (`session.loader(..., num_workers=W)`, balanced);
- emulated speeds 1,0.5: the same two;
- one rank's input pipeline slowed (fewer workers), speeds 1,1: hetrain with an even split, and balanced.
The device is emulated (hetrain/bench/emulated_device.py): the small CNN runs for real, and a
`DeviceTime` layer after it waits ``--device-ms`` per sample, leaving the CPU cores to the input
pipeline as an accelerator would. A rank at emulated speed s pads its compute (CNN and wait) to 1/s
of its time, as in every hetrain benchmark. Rank 0 writes the figures as JSON. Both modes' workers start
from a fork server, never forked from the rank (`worker_options`).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hetrain.bench.emulated_device import DeviceTime
from hetrain.runtime.environment import collect_at_exit
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


def small_cnn(width: int = 16, seed: int = 0, device_ms: float = 0.0) -> torch.nn.Module:
    """A small CNN; with ``device_ms``, followed by the emulated device's time for the batch at speed 1
    (a slower rank's timer pads it with the rest of its compute)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(width, 2 * width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(2 * width * 64, 10), DeviceTime(device_ms))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slow-workers", type=int, default=0, help="workers of the slowed rank's loader")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=30, help="steps per phase not timed (the balancer settles)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--device-ms", type=float, default=1.0, help="emulated device ms per sample at speed 1")
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--block", type=int, default=4, help="steps per timed block; modes alternate blocks")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def worker_options(workers: int) -> dict:
    """DataLoader options for `workers` persistent workers, started from a fork server. A worker forked from
    the rank itself can hang before it runs a line: CPython before 3.12 deadlocks a child forked while
    another thread creates an interpreter thread state (python/cpython#112275), which gloo's threads do when
    they free a finished collective's tensors or run a future's callback, as after DDP's all-reduce or
    session.loader()'s agreement; the rank then waits for its batch for ever and its peer in the step's
    all-reduce (a 300 s timeout of the suite, about one stuck child in 2,000 such forks here). The fork
    server is a fresh process without threads; it imports torch and this module once, for every worker."""
    if workers == 0:
        return {"num_workers": 0}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "PIL.Image", "hetrain.bench.data_job"])
    return {"num_workers": workers, "persistent_workers": True, "multiprocessing_context": context}


def _cycle(make_iter):
    while True:
        yield from make_iter()


class PlainDDP:
    """Plain DDP: DistributedSampler + DataLoader with the same workers, even split."""

    def __init__(self, args, data, slow: float | None) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = small_cnn(args.width, device_ms=args.device_ms)
        self.ddp = DistributedDataParallel(self.model)
        self.timer = StepTimer(speed=_speed(slow))   # pads the compute (CNN and device wait) to the speed
        self.ddp.register_comm_hook(TimedHookState(self.timer, None, default_hooks.allreduce_hook), timed_hook)
        self.timer.attach_ddp(self.ddp)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
        self.loader = DataLoader(data, batch_size=args.global_batch // world, sampler=self.sampler,
                                 drop_last=True, **worker_options(args.workers))
        self.epoch = 0
        self.batches = _cycle(self._epoch)
        self.shares = [args.global_batch // world] * world

    def _epoch(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def step(self) -> None:
        x, y = next(self.batches)
        F.cross_entropy(self.ddp(x), y).backward()
        self.timer.time_optimizer(self.opt.step)
        self.opt.zero_grad(set_to_none=True)
        self.timer.end_step()

    def figures(self) -> dict:
        return {"shares": self.shares}

    def close(self) -> None:
        del self.batches, self.loader


class Hetrain:
    """hetrain's Session and loader with `workers` workers on this rank; rank 1 at speed `slow`."""

    def __init__(self, args, data, slow: float | None, *, balance: bool, workers: int) -> None:
        import hetrain

        if slow is None:
            os.environ.pop(Env.EMULATE_SPEEDS, None)
        else:   # the Session pads the CNN's own compute to the rank's speed, as PlainDDP's timer does
            os.environ[Env.EMULATE_SPEEDS] = ",".join("1" if r != 1 else str(slow) for r in range(dist.get_world_size()))
        self.session = hetrain.Session(balance=balance, balance_interval=args.interval)
        self.model = small_cnn(args.width, device_ms=args.device_ms)
        self.ddp, _ = self.session.prepare(self.model, torch.optim.SGD(self.model.parameters(), lr=0.05))
        self.loader = self.session.loader(data, global_batch_size=args.global_batch, shuffle=True, seed=0,
                                          **worker_options(workers))
        self.batches = _cycle(lambda: iter(self.loader))
        self.waits: list[float] = []   # each step's wait for its batch
        self.untimed = max(1, args.warmup)   # compare() runs this many warm-up steps before the timed ones
        os.environ.pop(Env.EMULATE_SPEEDS, None)

    def step(self) -> None:
        x, y = next(self.batches)
        self.waits.append(self.loader.data_wait_seconds)
        self.session.backward(F.cross_entropy(self.ddp(x), y))
        self.session.step()

    def figures(self) -> dict:
        timed = self.waits[self.untimed:] or self.waits   # the timed steps after the warm-up
        # The balancer's final split, and the split of the last batch handed out: the loader's prefetched
        # batches keep the old split, so it trails a re-split by the prefetch depth (`Session.shares`).
        return {"balancer_shares": list(self.session.balancer.shares),
                "loader_shares": list(self.session.shares),
                "split_changes": [{"step": c.step, "new": c.new} for c in self.session.balancer.changes],
                "data_wait_ms_per_step": _gather(1e3 * sum(timed) / len(timed))}

    def close(self) -> None:
        self.session.close()
        del self.batches, self.loader


def _speed(slow: float | None) -> float:
    """This rank's emulated speed: rank 1 at `slow` (when given), the others at 1."""
    return slow if slow is not None and dist.get_rank() == 1 else 1.0


def _gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def compare(args, makers: dict) -> dict:
    """Make and warm up each mode, then alternate timed blocks of `args.block` steps between them, so a
    drift of this shared machine's speed falls on each alike; each rate is the median over its blocks.
    Each mode is made after the last one's warm-up: two sessions made side by side are a pair that
    trains on one batch (a GAN's), and the second would take the first's split."""
    modes = {}
    for name, make in makers.items():
        modes[name] = mode = make()
        for _ in range(max(1, args.warmup)):
            mode.step()
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(max(1, args.steps // args.block)):
        for name, mode in modes.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.block):
                mode.step()
            dist.barrier()
            rates[name].append(args.global_batch * args.block / (time.perf_counter() - t0))
    out = {name: {"samples_per_s": statistics.median(r), **modes[name].figures()} for name, r in rates.items()}
    for mode in modes.values():
        mode.close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    collect_at_exit()   # at exit: collect, and let gloo's workers free their last tensors (settle_at_exit)
    rank = dist.get_rank()
    data = JpegImages(args.samples)
    t0 = time.perf_counter()
    for i in range(32):
        data[i]
    decode_ms = 1e3 * (time.perf_counter() - t0) / 32
    slow = 0.5
    result: dict = {"world_size": dist.get_world_size(), "global_batch_size": args.global_batch,
                    "workers": args.workers, "slow_workers": args.slow_workers, "device_ms_per_sample": args.device_ms,
                    "timed_steps": args.block * max(1, args.steps // args.block),
                    "decode_ms_per_sample": _gather(decode_ms)}
    result.update(compare(args, {"ddp_1_1": lambda: PlainDDP(args, data, None),
                                 "hetrain_1_1": lambda: Hetrain(args, data, None, balance=True, workers=args.workers)}))
    result.update(compare(args, {"ddp_1_0.5": lambda: PlainDDP(args, data, slow),
                                 "hetrain_1_0.5": lambda: Hetrain(args, data, slow, balance=True, workers=args.workers)}))
    fewer = args.slow_workers if rank == 1 else args.workers
    result.update(compare(args, {"slow_loader_even": lambda: Hetrain(args, data, None, balance=False, workers=fewer),
                                 "slow_loader_hetrain": lambda: Hetrain(args, data, None, balance=True, workers=fewer)}))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ranks of `hetrain bench comm` (hetrain/bench/comm.py): plain DDP on CPU ranks over gloo, one
training run per compression hook, bytes and times recorded per hook. Kept apart from the verb so
that its flags are checked before torch is imported."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from hetrain.bench.comm import WIDTH, parse_islands
from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import build_comm_hook, ddp_kwargs
from hetrain.runtime.environment import collect_at_exit


def _digits(seed: int) -> tuple[torch.Tensor, ...]:
    from sklearn.model_selection import train_test_split

    from hetrain.bench.digits import load_digits_arrays

    x, y = load_digits_arrays()
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.tensor(xtr, dtype=torch.float32), torch.tensor(ytr), torch.tensor(xte, dtype=torch.float32),
            torch.tensor(yte))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def _global_batches(n_train: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The same sequence of global batches for every hook and every rank count."""
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n_train, generator=g) for _ in range(steps * batch // n_train + 1)])
    return [order[i * batch:(i + 1) * batch] for i in range(steps)]


def _train(rank: int, world: int, args: argparse.Namespace, comm: CommPlan, data: tuple) -> dict:
    xtr, ytr, xte, yte = data
    model = _model(args.seed)
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs(comm))
    state, hook = build_comm_hook(comm)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    batches = _global_batches(len(xtr), args.global_batch_size, args.steps, args.seed)
    per = args.global_batch_size // world
    timed_from = min(args.steps // 5, 20)
    bytes_at = {}
    for step, idx in enumerate(batches):
        if step == timed_from:
            dist.barrier()
            t0 = time.perf_counter()
        if step == comm.powersgd_warmup_steps:
            bytes_at["warmup_end"] = state.stats.bytes_sent
        mine = idx[rank * per:(rank + 1) * per]
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddp(xtr[mine]), ytr[mine]).backward()
        opt.step()
    dist.barrier()
    step_s = (time.perf_counter() - t0) / (args.steps - timed_from)
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    stats = state.stats
    after = args.steps - comm.powersgd_warmup_steps
    return {
        "bytes_per_step": stats.bytes_per_step(),
        "bytes_per_step_after_warmup": (stats.bytes_sent - bytes_at.get("warmup_end", 0.0)) / after,
        "bytes_by_level": {k: v / stats.steps for k, v in stats.bytes_by_level.items()},
        "step_s": step_s,
        "hidden_fraction": stats.hidden_fraction(),
        "test_accuracy": accuracy,
    }


def _rank_main(rank: int, world: int, args: argparse.Namespace, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    collect_at_exit()   # at exit: collect, and let gloo's workers free their last tensors (settle_at_exit)
    islands = parse_islands(args.islands) if args.islands else None
    data = _digits(args.seed)
    results = {}
    for name in args.hooks.split(","):
        comm = CommPlan(compression=name, powersgd_rank=args.powersgd_rank,
                        powersgd_warmup_steps=args.powersgd_warmup_steps, topk_ratio=args.topk_ratio,
                        bucket_cap_mb=args.bucket_cap_mb, hierarchical=islands is not None, islands=islands)
        results[name] = _train(rank, world, args, comm, data)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> tuple[dict, float, int]:
    """(figures per hook from rank 0, wall seconds, model parameters): one run per hook on
    ``args.ranks`` spawned CPU ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        t0 = time.perf_counter()
        mp.spawn(_rank_main, args=(args.ranks, args, store, out), nprocs=args.ranks, join=True)
        wall = time.perf_counter() - t0
        with open(out) as f:
            per_hook = json.load(f)
    return per_hook, wall, sum(p.numel() for p in _model(args.seed).parameters())

"""`hetrain bench comm`: bytes per step, step time, hidden communication and accuracy of each hook.

Plain DistributedDataParallel on CPU ranks over gloo trains an MLP (64-512-512-512-10, every hidden
layer at least 256x256) on scikit-learn's digits (fixed seed, fixed 80/20 split) for a fixed
number of steps once per compression, with the same data and initial weights, and reports for each
hook the bytes a rank sends per step and their ratio to uncompressed, the step time, the hidden
fraction of communication (docs/communication.md) and the test accuracy reached.
"""

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

from hetrain.errors import HetrainError
from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import build_comm_hook, ddp_kwargs
from hetrain.runtime.environment import collect_at_exit
from hetrain.vocabulary import COMPRESSIONS

HOOKS = list(COMPRESSIONS)
TARGET_RATIO = {"powersgd": 0.10, "int8": 0.27, "topk": 0.03}  # on 2 ranks
WIDTH = 512


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo)")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps per hook")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hooks", default=",".join(HOOKS), help="comma-separated compressions")
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--powersgd-warmup-steps", type=int, default=10)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25, help="DDP bucket size (several buckets overlap)")
    parser.add_argument("--islands", default=None, help="two-level all-reduce over islands, e.g. '0,1;2,3'")
    parser.add_argument("--seed", type=int, default=0)


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
    islands = [[int(r) for r in part.split(",")] for part in args.islands.split(";")] if args.islands else None
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


def run(args: argparse.Namespace) -> dict:
    """Train once per hook on ``args.ranks`` CPU ranks; figures per hook and against ``none``."""
    hooks = args.hooks.split(",")
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown or "none" not in hooks:
        raise HetrainError(f"--hooks {args.hooks}: give compressions from {HOOKS}, including 'none' (the baseline)")
    if args.ranks < 1 or args.global_batch_size % args.ranks:
        raise HetrainError(
            f"--ranks {args.ranks} with --global-batch-size {args.global_batch_size}: the batch must split evenly; "
            "pick a batch size divisible by the rank count"
        )
    if args.powersgd_warmup_steps < 0 or args.steps <= args.powersgd_warmup_steps:
        raise HetrainError(
            f"--steps {args.steps} must be larger than --powersgd-warmup-steps {args.powersgd_warmup_steps} "
            "(>= 0): the figures after warm-up are taken on the steps after it"
        )
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        t0 = time.perf_counter()
        mp.spawn(_rank_main, args=(args.ranks, args, store, out), nprocs=args.ranks, join=True)
        wall = time.perf_counter() - t0
        with open(out) as f:
            per_hook = json.load(f)
    base = per_hook["none"]
    for name, r in per_hook.items():
        r["ratio_to_none"] = r["bytes_per_step"] / base["bytes_per_step"]
        r["ratio_after_warmup"] = r["bytes_per_step_after_warmup"] / base["bytes_per_step_after_warmup"]
        r["step_time_ratio"] = r["step_s"] / base["step_s"]
        r["accuracy_delta_pp"] = 100.0 * (r["test_accuracy"] - base["test_accuracy"])
    checks = {}
    if args.ranks == 2 and not args.islands:
        for name, limit in TARGET_RATIO.items():
            if name in per_hook:
                checks[f"{name}_ratio_le_{limit}"] = per_hook[name]["ratio_to_none"] <= limit
    for name, r in per_hook.items():
        if name != "none":
            checks[f"{name}_accuracy_within_1pp"] = r["accuracy_delta_pp"] >= -1.0
    params = sum(p.numel() for p in _model(args.seed).parameters())
    return {
        "ranks": args.ranks,
        "steps": args.steps,
        "global_batch_size": args.global_batch_size,
        "model": f"mlp 64-{WIDTH}-{WIDTH}-{WIDTH}-10 ({params} parameters), digits 80/20 split, seed {args.seed}",
        "islands": args.islands,
        "hooks": per_hook,
        "checks": checks,
        "wall_s": wall,
        "emulated": False,
    }

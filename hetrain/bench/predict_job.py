"""The worker of `hetrain bench predict` (run under `hetrain launch --plan plan.json -m`).

Trains the benchmark's model with hetrain's Session on random data, as the plan says, and rank 0
writes the wall seconds of each optimizer step (data, forward, backward, all-reduce, optimizer,
balancer: everything a user's step costs) and the process CPU seconds of each, as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import hetrain
from hetrain.bench.digits import digits_cnn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    session = hetrain.Session()
    model = digits_cnn(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = session.prepare(model, optimizer)
    g = torch.Generator().manual_seed(0)
    n = args.global_batch_size * args.steps
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    loader = session.loader(data, global_batch_size=args.global_batch_size, shuffle=False, seed=0)
    ends, cpu_ends = [time.perf_counter()], [time.process_time()]
    for x, y in loader:
        with session.autocast():
            loss = F.cross_entropy(model(x), y)
        session.backward(loss)
        if session.step():
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
    if session.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_seconds": [b - a for a, b in zip(ends, ends[1:])],
                       "step_cpu_seconds": [b - a for a, b in zip(cpu_ends, cpu_ends[1:])], "shares": list(session.shares),
                       "world_size": session.world_size}, f)
    session.close()


if __name__ == "__main__":
    main()

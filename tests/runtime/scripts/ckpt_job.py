"""A deterministic job for restart tests: trains to --steps, can SIGKILL one rank once."""

import argparse
import os
import signal

import torch
import torch.nn.functional as F

import hetrain
from hetrain.bench.digits import digits_datasets, digits_mlp

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=24)
p.add_argument("--interval", type=int, default=4)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.manual_seed(1234)   # the same on every start; a resumed run restores its own RNG state

session = hetrain.Session(balance=False, checkpoint_interval=args.interval, async_checkpoints=True)
train, _ = digits_datasets()
net = digits_mlp(hidden=64)
model, opt = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3))
loader = session.loader(train, global_batch_size=96, seed=5)
if session.is_main:
    print(f"start at step {session.step_count} (restart {session.restart_count})", flush=True)
while session.step_count < args.steps:
    for x, y in loader:
        x = x + 0.01 * torch.randn_like(x)    # RNG in the loop: a resume must restore it exactly
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if (session.step_count == args.kill_step and session.rank == args.kill_rank
                and session.restart_count == 0):
            os.kill(os.getpid(), signal.SIGKILL)
        if session.step_count >= args.steps:
            break
session.close()
if session.rank == 0:
    torch.save({k: v.clone() for k, v in net.state_dict().items()}, args.out)

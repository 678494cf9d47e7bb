"""examples/ddp_plain.py ported to hetrain (the diff is in docs/porting.md). The session's checkpoints
take the place of the snapshot as the way to resume (the snapshot is still written, as the model's
weights): a restarted run goes on from the step and the epoch where the last checkpoint left it.

    hetrain launch --nproc-per-node 2 --emulate-speeds 1,0.5 examples/ddp_hetrain.py --epochs 3
    hetrain launch --nproc-per-node 2 --max-restarts 1 --checkpoint-dir ckpt examples/ddp_hetrain.py --epochs 3
"""

import argparse

import torch
from torch.utils.data import TensorDataset

import hetrain

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--global-batch-size", type=int, default=64, help="samples per step, all ranks together")
parser.add_argument("--snapshot", default="snapshot.pt")
args = parser.parse_args()

session = hetrain.Session()
rank, world, device = session.rank, session.world_size, session.device

g = torch.Generator().manual_seed(0)
x = torch.randn(2048, 20, generator=g)
dataset = TensorDataset(x, x @ torch.randn(20, 1, generator=g) + 0.1 * torch.randn(2048, 1, generator=g))
torch.manual_seed(0)   # every rank and both scripts build the same initial weights
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = session.prepare(model, optimizer)
loader = session.loader(dataset, global_batch_size=args.global_batch_size, shuffle=True, seed=0)

while loader.epoch < args.epochs:   # a restarted run (--checkpoint-dir) goes on mid-epoch
    total, steps = 0.0, 0
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        session.backward(loss)
        if session.step():   # True once the step's update is applied (after its last micro-batch)
            total, steps = total + session.loss, steps + 1
    epoch = loader.epoch - 1   # the epoch this pass finished
    if rank == 0:
        print(f"epoch {epoch} loss {total / max(steps, 1):.4f}", flush=True)
        torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.snapshot)
session.close()

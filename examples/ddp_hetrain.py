"""examples/ddp_plain.py ported to hetrain (the diff is in docs/porting.md).

    hetrain launch --nproc-per-node 2 --emulate-speeds 1,0.5 examples/ddp_hetrain.py --epochs 3
"""

import argparse
import os

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
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
if os.path.exists(args.snapshot):
    snapshot = torch.load(args.snapshot, map_location=device)
    model.load_state_dict(snapshot["model"])
    start = snapshot["epoch"] + 1
model, optimizer = session.prepare(model, optimizer)
loader = session.loader(dataset, global_batch_size=args.global_batch_size, shuffle=True, seed=0)

for epoch in range(start, args.epochs):
    total = 0.0
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        session.backward(loss)
        if session.step():   # True once the step's update is applied (after its last micro-batch)
            total += session.loss
    if rank == 0:
        print(f"epoch {epoch} loss {total / len(loader):.4f}", flush=True)
        torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.snapshot)
session.close()

"""A plain torchrun DDP script, as people write them: DistributedSampler, DataLoader, DDP, and a
snapshot of its own. `docs/porting.md` shows it ported to hetrain (examples/ddp_hetrain.py).

    torchrun --nproc-per-node 2 examples/ddp_plain.py --epochs 3
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
parser.add_argument("--snapshot", default="snapshot.pt")
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")

g = torch.Generator().manual_seed(0)
x = torch.randn(2048, 20, generator=g)
dataset = TensorDataset(x, x @ torch.randn(20, 1, generator=g) + 0.1 * torch.randn(2048, 1, generator=g))
torch.manual_seed(0)   # every rank and both scripts build the same initial weights
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
if os.path.exists(args.snapshot):
    snapshot = torch.load(args.snapshot, map_location=device)
    model.load_state_dict(snapshot["model"])
    start = snapshot["epoch"] + 1
model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
sampler = DistributedSampler(dataset, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, pin_memory=True)

for epoch in range(start, args.epochs):
    sampler.set_epoch(epoch)
    total = 0.0
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        total += loss.item()
    if rank == 0:
        print(f"epoch {epoch} loss {total / len(loader):.4f}", flush=True)
        torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.snapshot)
dist.destroy_process_group()

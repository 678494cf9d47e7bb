"""The training loop of README.md on scikit-learn's digits. Run it on 2 CPU ranks:

    hetrain launch --nproc-per-node 2 --emulate-speeds 1,0.5 examples/train_digits.py --epochs 5
"""

import argparse

import torch
import torch.nn.functional as F

import hetrain
from hetrain.bench.digits import accuracy, digits_datasets, digits_mlp

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch_size", type=int, default=128)
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()

session = hetrain.Session()
train, test = digits_datasets()
model = digits_mlp(hidden=128)
model, optimizer = session.prepare(model, torch.optim.Adam(model.parameters(), lr=args.lr))
loader = session.loader(train, global_batch_size=args.global_batch_size, shuffle=True, seed=0)

while loader.epoch < args.epochs:          # resumes mid-epoch after a restart
    losses = []
    for x, y in loader:                     # this rank's share of one global batch, on its device
        with session.autocast():            # this device's precision
            loss = F.cross_entropy(model(x), y)
        session.backward(loss)              # weighted by this rank's share of the global batch
        if session.step():                  # True once the update is applied (after a step's last micro-batch)
            losses.append(session.loss)     # the global batch's mean loss, the same on every rank
    if session.is_main:
        print(f"epoch {loader.epoch - 1} loss {sum(losses) / max(len(losses), 1):.4f} shares {session.shares} "
              f"test accuracy {accuracy(model.module, test):.3f}", flush=True)
session.close()

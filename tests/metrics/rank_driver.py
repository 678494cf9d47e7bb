"""A small data-parallel loop that reports to RankMetrics as a Session does, for the metrics tests.

Run it with `hetrain launch --nproc-per-node 2 --metrics-port P tests/metrics/rank_driver.py --run-dir D`.
Rank 1 computes twice as long as rank 0, so rank 0 waits on it; the split changes halfway; every
fifth step saves a checkpoint. After the last step the ranks keep serving, meeting in an all-reduce
every 0.1 s, until `--stop-file` appears (a rank stopped by the test leaves the other blocked there).
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hetrain.metrics import RankMetrics
from hetrain.metrics.events import CheckpointRecord, StepRecord
from hetrain.vocabulary import Env

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--compute-seconds", type=float, default=0.02, help="rank 0's padded compute; rank r's is (r+1)x")
parser.add_argument("--run-dir", required=True)
parser.add_argument("--stop-file", default=None)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
run_dir = Path(args.run_dir)
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / f"pid-{rank}").write_text(str(os.getpid()))
torch.manual_seed(0)
model = torch.nn.Linear(32, 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
flops_per_item = 6 * sum(p.numel() for p in model.parameters())  # forward + backward of a linear layer
port = os.environ.get(Env.METRICS_PORT)
metrics = RankMetrics(rank=rank, local_rank=int(os.environ["LOCAL_RANK"]), world_size=world,
                      device=torch.device("cpu"), device_name="cpu", port=int(port) if port else None,
                      run_dir=run_dir, job=os.environ.get("TORCHELASTIC_RUN_ID", "driver"),
                      predicted_step_seconds=0.03 * (rank + 1), flops_per_item=flops_per_item)
metrics.on_restart(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

global_batch = 64
shares = [48, 16]
previous_end = None
for step in range(1, args.steps + 1):
    split_changed = step == args.steps // 2
    if split_changed:
        shares = [40, 24]
    t0 = time.perf_counter()
    x, y = torch.randn(shares[rank], 32), torch.randn(shares[rank], 10)
    time.sleep(0.002)  # stands in for the loader
    t1 = time.perf_counter()
    loss = (model(x) - y).square().mean()
    (loss * shares[rank] / global_batch).backward()
    time.sleep(args.compute_seconds * (rank + 1))
    t2 = time.perf_counter()
    sent = 0.0
    for p in model.parameters():
        dist.all_reduce(p.grad)
        sent += p.grad.numel() * p.grad.element_size() * 2 * (world - 1) / world  # ring all-reduce
    t3 = time.perf_counter()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) if step % 2 == 0 else None
    optimizer.step()
    optimizer.zero_grad()
    global_loss = loss.detach() * shares[rank] / global_batch
    dist.all_reduce(global_loss)
    end = time.perf_counter()
    metrics.on_step(StepRecord(
        step=step, rank=rank, world_size=world, device="cpu", precision="fp32", share=shares[rank],
        samples=shares[rank], items=shares[rank] * 8, global_samples=global_batch, global_items=global_batch * 8,
        step_seconds=None if previous_end is None else end - previous_end,
        compute_seconds=(t2 - t1) + (end - t3), data_wait_seconds=t1 - t0, optimizer_seconds=end - t3,
        loss=float(global_loss), grad_norm=grad_norm, loss_scale=1.0, skipped=False, skipped_total=0,
        shares=tuple(shares), split_changed=split_changed, comm_bytes={"intra": sent}, emulated=True))
    previous_end = end
    if step % 5 == 0:
        t = time.perf_counter()
        path = run_dir / f"ckpt-{rank}.pt"
        torch.save(model.state_dict(), path)
        elapsed = time.perf_counter() - t
        metrics.on_checkpoint(CheckpointRecord(step=step, blocking_seconds=elapsed, total_seconds=elapsed,
                                               bytes=path.stat().st_size))
(run_dir / f"done-{rank}").write_text(str(args.steps))

stop = torch.zeros(1)
while not stop.item():
    stop.fill_(1.0 if args.stop_file is None or Path(args.stop_file).exists() else 0.0)
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    time.sleep(0.1)
metrics.close()
dist.destroy_process_group()

"""A bare torch.distributed job with hetrain's ProgressWatch: steps of work and an all-reduce.

    hetrain launch --nproc-per-node 3 --collective-timeout 4 tests/faults/stall_job.py --hang 1:5

--hang R:S: rank R sleeps forever when it starts step S (its watch thread still speaks).
--freeze R:S: rank R holds the interpreter lock forever at step S (no thread of it can speak).
"""

import argparse
import ctypes
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hetrain.runtime.watchdog import ProgressWatch
from hetrain.vocabulary import Env


def where(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    rank, step = text.split(":")
    return int(rank), int(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hang", default=None)
    parser.add_argument("--freeze", default=None)
    args = parser.parse_args()
    timeout = float(os.environ[Env.COLLECTIVE_TIMEOUT])
    dist.init_process_group("gloo", timeout=timedelta(seconds=3 * timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=False)
    store = dist.PrefixStore(f"stall-job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    watch = ProgressWatch(store, rank, world, timeout, interval_s=0.5)
    watch.start()
    x = torch.ones(1)
    for step in range(1, args.steps + 1):
        watch.computing(step)
        if where(args.hang) == (rank, step):
            print(f"rank {rank} hangs at step {step} at {time.time()}", flush=True)
            while True:
                time.sleep(3600)
        if where(args.freeze) == (rank, step):
            print(f"rank {rank} freezes at step {step} at {time.time()}", flush=True)
            ctypes.PyDLL(None).sleep(3600)   # a C call that keeps the interpreter lock
        time.sleep(0.02)
        watch.waiting(step)
        dist.all_reduce(x)
    watch.stop()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

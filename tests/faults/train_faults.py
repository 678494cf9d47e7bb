"""The loop of README.md on the digits MLP, with faults injected from `HETRAIN_TEST_FAULTS`.

    HETRAIN_TEST_FAULTS="nan@1:5,raise@0:7" hetrain launch --nproc-per-node 2 tests/faults/train_faults.py

Each fault is KIND@RANK:STEP and fires on that rank when it starts that step (steps count from 1),
in the first attempt only, so a restarted job can finish; before a fault a restart follows, the rank
waits until the last checkpoint before that step is committed, so the restart resumes from it. Kinds:
  nan, inf     the rank's loss is NaN (inf) at that step
  raise        the rank raises RuntimeError
  hang         the rank sleeps forever (its peers wait in the next collective)
  exit         the rank ends with os._exit(3), no clean-up
  kill         the rank sends itself SIGKILL
  killlauncher the rank sends SIGKILL to its parent, the `hetrain launch` process
  killckpt     the rank sends itself SIGKILL inside the next checkpoint write
  raiseslow    the rank raises, and takes 3 s to exit after closing its connections (a slow teardown)
The loop draws random numbers and trains with Adam, so a restart that ends on the uninterrupted
job's parameters restored the RNG and the optimizer's state exactly.
At the end rank 0 prints `final step N finite F digest D`: D is a hash of the model's parameters,
F whether they are all finite.
"""

import argparse
import hashlib
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain
from hetrain.bench.digits import digits_datasets, digits_mlp
from hetrain.checkpoint.store import committed
from hetrain.vocabulary import Env

FAULTS_ENV = "HETRAIN_TEST_FAULTS"
KINDS = ("nan", "inf", "raise", "hang", "exit", "kill", "killlauncher", "killckpt", "raiseslow")
# a restart resumes after these: each waits first for the last checkpoint before its step to be
# committed (killckpt too, or its kill could land in that checkpoint's commit instead of the next write)
RESTARTING = ("raise", "hang", "exit", "kill", "killlauncher", "killckpt", "raiseslow")


def parse_faults(text: str) -> dict[tuple[int, int], str]:
    """"kind@rank:step,..." -> {(rank, step): kind}."""
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        kind, _, where = item.partition("@")
        rank, _, step = where.partition(":")
        if kind not in KINDS:
            raise SystemExit(f"unknown fault kind {kind!r}; one of {KINDS}")
        out[(int(rank), int(step))] = kind
    return out


def kill_in_next_fsync() -> None:
    """SIGKILL this process when the checkpoint writer next syncs a file: data written, not committed."""
    real = os.fsync

    def fsync(fd: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        real(fd)

    os.fsync = fsync


def wait_for_committed_checkpoint(step: int, timeout_s: float = 20.0) -> None:
    """Before a fault at `step`, wait until the checkpoint of the last interval before it is committed
    (saves run in the background): a restart then resumes from it, not from step 0."""
    root, interval = os.environ.get(Env.CHECKPOINT_DIR), int(os.environ.get(Env.CHECKPOINT_INTERVAL, "0") or 0)
    if not root or interval <= 0 or step <= interval:
        return
    want = (step - 1) // interval * interval
    deadline = time.monotonic() + timeout_s
    while not any(s >= want for s, _ in committed(Path(root))) and time.monotonic() < deadline:
        time.sleep(0.01)


def inject(kind: str, rank: int, step: int) -> float:
    """Fire one fault; returns the factor the loss is multiplied by."""
    if kind in RESTARTING:
        wait_for_committed_checkpoint(step)
    print(f"injecting {kind} on rank {rank} at step {step} at {time.time():.3f}", flush=True)
    if kind == "nan":
        return float("nan")
    if kind == "inf":
        return float("inf")
    if kind == "raiseslow":
        import atexit

        import torch.distributed as dist

        atexit.register(lambda: (dist.destroy_process_group(), time.sleep(3)))
    if kind in ("raise", "raiseslow"):
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "killlauncher":
        os.kill(os.getppid(), signal.SIGKILL)
    if kind == "killckpt":
        kill_in_next_fsync()
    return 1.0


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (slow jobs)")
    args = parser.parse_args()
    faults = parse_faults(os.environ.get(FAULTS_ENV, ""))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        faults = {}

    torch.manual_seed(1234)   # the same on every start; a resumed run restores its own RNG state
    session = hetrain.Session()
    train, _ = digits_datasets()
    net = digits_mlp(hidden=32)
    model, optimizer = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    loader = session.loader(train, global_batch_size=args.global_batch, shuffle=True, seed=0)
    step = getattr(session, "step_count", 0)   # a restart resumes from the last checkpoint
    print(f"rank {session.rank} starts at step {step} pid {os.getpid()} parent {os.getppid()}", flush=True)
    while step < args.steps:
        for x, y in loader:
            step += 1
            scale = inject(faults[(session.rank, step)], session.rank, step) \
                if (session.rank, step) in faults else 1.0
            x = x + 0.01 * torch.randn_like(x)    # RNG in the loop: a resume must restore it exactly
            with session.autocast():
                loss = F.cross_entropy(model(x), y) * scale
            session.backward(loss)
            session.step()
            time.sleep(args.step_sleep)
            if step >= args.steps:
                break
    finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    if session.rank == 0:
        print(f"final step {step} finite {finite} digest {digest(net)}", flush=True)
    session.close()


if __name__ == "__main__":
    main()

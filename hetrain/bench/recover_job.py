"""The worker of `hetrain bench recover` (run under `hetrain launch -m`, with checkpoints).

A deterministic Session job on the digits task with an MLP of ~40 MB of model and Adam state.
Each rank appends wall-clock events (`time.time()`, one JSON line each) to `<events>/rank<R>.jsonl`:
`start` (process started), `ready` (process group up), `prepared` (data and model built),
`resumed` (checkpoint restored, with the step), `step` (a step completed), `death` (written just
before this rank SIGKILLs itself). Rank 0 writes the final parameters to `--out`; with
`--measure-saves N` every rank then times N synchronous and N background saves of the same state
in a directory of their own.
"""

from __future__ import annotations

import time

_STARTED = time.time()  # before torch is imported: the restart's process start-up is part of recovery

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5, help="checkpoint interval (steps)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=int, default=128)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1, help="SIGKILL --kill-rank after this step (first attempt)")
    p.add_argument("--events", required=True, help="directory for the per-rank event files")
    p.add_argument("--out", required=True, help="rank 0 writes the final parameters here")
    p.add_argument("--measure-saves", type=int, default=0, help="time this many sync and background saves")
    return p.parse_args(argv)


class Events:
    """Appends one JSON line per event to this rank's file (each line is one write)."""

    def __init__(self, directory: str, rank: int, restart: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"rank{rank}.jsonl"
        self.restart = restart

    def __call__(self, event: str, t: float | None = None, **fields: object) -> None:
        line = json.dumps({"event": event, "t": time.time() if t is None else t, "restart": self.restart, **fields})
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def measure_saves(session, directory: Path, repeats: int) -> dict:
    """Median seconds of a synchronous save, and of a background save's blocking part, of the session's state."""
    from hetrain.checkpoint.checkpointer import Checkpointer

    shared, per_rank, sharded = session.checkpoints.state.capture()
    sync = Checkpointer(directory / "sync", keep=1, async_save=False)
    background = Checkpointer(directory / "background", keep=1, async_save=True)
    sync_s, blocking_s, background_total_s = [], [], []
    for i in range(repeats + 1):  # the first of each allocates (files, host copies): not counted
        sync.save(i, shared, per_rank, sharded)
        background.save(i, shared, per_rank, sharded)
        blocking = background.last_blocking_seconds
        background.wait()
        if i > 0:
            sync_s.append(sync.last_save_seconds)
            blocking_s.append(blocking)
            background_total_s.append(background.last_save_seconds)
        if i == 0:
            first_blocking = blocking
    sync.close()
    background.close()
    return {"sync_save_seconds": statistics.median(sync_s), "blocking_seconds": statistics.median(blocking_s),
            "background_save_seconds": statistics.median(background_total_s),
            "first_blocking_seconds": first_blocking, "bytes": sync.last_bytes, "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    torch.set_num_threads(1)
    rank, restart = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Events(args.events, rank, restart)
    events("start", t=_STARTED)
    torch.manual_seed(1234)  # the same on every start; a resumed run restores its own RNG states
    session = hetrain.Session(balance=False, checkpoint_interval=args.interval, async_checkpoints=True)
    events("ready")
    train, _ = digits_datasets()
    net = digits_mlp(hidden=args.hidden, depth=args.depth)
    model, _ = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-4))
    events("prepared")
    loader = session.loader(train, global_batch_size=args.global_batch, seed=5)  # resumes when it can
    events("resumed", step=session.step_count)
    while session.step_count < args.steps:
        for x, y in loader:
            x = x + 0.01 * torch.randn_like(x)  # RNG in the loop: a resume must restore it exactly
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            events("step", step=session.step_count)
            if session.step_count == args.kill_step and rank == args.kill_rank and restart == 0:
                events("death", step=session.step_count)
                os.kill(os.getpid(), signal.SIGKILL)
            if session.step_count >= args.steps:
                break
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, args.out)
    if args.measure_saves > 0:
        figures = measure_saves(session, Path(args.out).parent / "measure", args.measure_saves)
        if rank == 0:
            Path(args.out).with_suffix(".saves.json").write_text(json.dumps(figures))
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`hetrain bench recover`: a rank killed mid-run, restarted by the elastic agent, against an uninterrupted run.

Two launches of the same 2-rank CPU job (`hetrain.bench.recover_job`) through hetrain's launcher
with checkpoints: an uninterrupted one, which also times synchronous and background saves of the
job's state, and one whose rank 1 SIGKILLs itself after `--kill-step` and is restarted by the
elastic agent (`max_restarts=1`), resuming from the newest checkpoint. Figures:

- `steps_lost`: the kill step minus the step the restart resumed from (steps computed twice);
- `recovery_seconds`: wall time from the death to the first step completed after the restart,
  with its parts (`detect_and_restart_seconds` to the new processes' start, `startup_seconds`
  to their process group, `build_seconds` to data and model built, `resume_seconds` to the
  restored checkpoint, `first_step_seconds`);
- `final_params_equal`: the killed-and-restarted run ends with exactly the uninterrupted run's parameters;
- `checkpoint_save_seconds` (a synchronous save), `checkpoint_blocking_seconds` (the part of a
  background save that blocks training), `blocking_ratio`, `checkpoint_bytes`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hetrain.bench.args import number, whole
from hetrain.errors import HetrainError
from hetrain.launch.launcher import LaunchConfig, launch

JOB = "hetrain.bench.recover_job"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=whole(2), default=40, help="training steps")
    parser.add_argument("--interval", type=whole(1), default=5, help="checkpoint interval in steps")
    parser.add_argument("--kill-step", type=whole(1), default=None,
                        help="rank 1 is killed after this step (default: the step before the third checkpoint)")
    parser.add_argument("--hidden", type=whole(1), default=1024, help="MLP width (state bytes grow with its square)")
    parser.add_argument("--depth", type=whole(1), default=4, help="MLP hidden layers")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=whole(2), default=128,
                        help="samples per step, split over the ranks")
    parser.add_argument("--monitor-interval", type=number(above=0), default=0.1,
                        help="seconds between the elastic agent's checks of its workers")
    parser.add_argument("--measure-saves", type=int, default=3,
                        help="timed saves of each kind (0: none, and no checkpoint_* figures)")


def _job_args(args: argparse.Namespace, events: Path, out: Path) -> list[str]:
    return ["--steps", str(args.steps), "--interval", str(args.interval), "--hidden", str(args.hidden),
            "--depth", str(args.depth), "--global-batch-size", str(args.global_batch),
            "--events", str(events), "--out", str(out)]


def _launch(args: argparse.Namespace, job_args: list[str], checkpoints: Path, restarts: int) -> None:
    launch(LaunchConfig(script=JOB, module=True, script_args=job_args, nproc_per_node=2, max_restarts=restarts,
                        monitor_interval=args.monitor_interval, checkpoint_dir=str(checkpoints)))


def read_events(directory: Path) -> list[dict]:
    """Every rank's events, each with its `rank`, in time order."""
    found = []
    for path in sorted(directory.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        found += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines() if line]
    return sorted(found, key=lambda e: e["t"])


def recovery_figures(events: list[dict]) -> dict:
    """Steps lost and the recovery timeline (death to the first step after the restart) from the events."""
    deaths = [e for e in events if e["event"] == "death"]
    if len(deaths) != 1:
        raise HetrainError(f"expected one rank to die, found {len(deaths)} death events; rerun the benchmark")
    death = deaths[0]
    after = [e for e in events if e["restart"] >= 1]

    def first(kind: str) -> dict:
        hits = [e for e in after if e["event"] == kind]
        if not hits:
            raise HetrainError(f"no {kind!r} event after the restart; the restart did not get that far")
        return hits[0]

    resumed = first("resumed")
    stepped = first("step")

    def last(kind: str) -> float:
        first(kind)
        return max(e["t"] for e in after if e["event"] == kind)

    return {
        "kill_step": death["step"],
        "resumed_from_step": resumed["step"],
        "steps_lost": death["step"] - resumed["step"],
        "recovery_seconds": stepped["t"] - death["t"],
        # the parts, each up to the later of the new ranks
        "detect_and_restart_seconds": last("start") - death["t"],
        "startup_seconds": last("ready") - last("start"),
        "build_seconds": last("prepared") - last("ready"),
        "resume_seconds": last("resumed") - last("prepared"),
        "first_step_seconds": stepped["t"] - last("resumed"),
    }


def _params_equal(a: Path, b: Path) -> bool:
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run(args: argparse.Namespace) -> dict:
    kill_step = args.kill_step if args.kill_step is not None else 3 * args.interval - 1
    if args.interval < 1:
        raise HetrainError(f"--interval {args.interval} must be >= 1")
    if args.measure_saves < 0:
        raise HetrainError(f"--measure-saves {args.measure_saves} must be >= 0 (0: no timed saves)")
    if args.kill_step is None and kill_step >= args.steps:
        steps = "1" if args.steps == 2 else f"between 1 and {args.steps - 1}"
        raise HetrainError(f"--steps {args.steps} ends before the default --kill-step {kill_step} (the step before the "
                           f"third checkpoint: 3 x --interval - 1); fix: --steps {kill_step + 1} or more, or a smaller "
                           f"--interval, or --kill-step {steps}")
    if not 0 < kill_step < args.steps:
        raise HetrainError(f"--kill-step {kill_step} must be between 1 and --steps - 1 ({args.steps - 1})")
    with tempfile.TemporaryDirectory(prefix="hetrain-bench-recover-") as tmp:
        root = Path(tmp)
        clean = _job_args(args, root / "clean-events", root / "clean" / "params.pt")
        (root / "clean").mkdir()
        t0 = time.perf_counter()
        _launch(args, [*clean, "--measure-saves", str(args.measure_saves)], root / "clean-ckpt", restarts=0)
        clean_seconds = time.perf_counter() - t0
        killed = _job_args(args, root / "killed-events", root / "killed" / "params.pt")
        (root / "killed").mkdir()
        t0 = time.perf_counter()
        _launch(args, [*killed, "--kill-rank", "1", "--kill-step", str(kill_step)], root / "killed-ckpt", restarts=1)
        killed_seconds = time.perf_counter() - t0
        recovery = recovery_figures(read_events(root / "killed-events"))
        saves = json.loads((root / "clean" / "params.saves.json").read_text()) if args.measure_saves > 0 else None
        equal = _params_equal(root / "clean" / "params.pt", root / "killed" / "params.pt")
        clean_steps = [e for e in read_events(root / "clean-events") if e["event"] == "step" and e["rank"] == 0]
    step_seconds = (clean_steps[-1]["t"] - clean_steps[0]["t"]) / max(1, len(clean_steps) - 1)
    timed_saves = {} if saves is None else {
        "checkpoint_save_seconds": saves["sync_save_seconds"],
        "checkpoint_blocking_seconds": saves["blocking_seconds"],
        "blocking_ratio": saves["blocking_seconds"] / saves["sync_save_seconds"],
        "checkpoint_background_save_seconds": saves["background_save_seconds"],
        "checkpoint_first_blocking_seconds": saves["first_blocking_seconds"],
        "checkpoint_bytes": saves["bytes"],
    }
    return {
        "world_size": 2,
        "steps": args.steps,
        "checkpoint_interval": args.interval,
        **recovery,
        "steps_lost_within_interval": recovery["steps_lost"] <= args.interval,
        "final_params_equal": equal,
        **timed_saves,
        "step_seconds": step_seconds,
        "monitor_interval": args.monitor_interval,
        "uninterrupted_run_seconds": clean_seconds,
        "killed_run_seconds": killed_seconds,
        "emulated": False,   # a real kill and restart on CPU ranks
    }

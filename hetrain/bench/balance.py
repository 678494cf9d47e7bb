"""`hetrain bench balance`: plain DDP (even split) against hetrain (balanced), on emulated speeds.

Figures are ratios measured in one run: `speedup` = balanced / uniform samples/s, and
`efficiency` = balanced / ideal, where ideal is the sum of each rank's own rate training alone
(no communication) in the same run. With `--metrics`, hetrain also runs blocks with its Prometheus
metrics on (the same session, the observer attached): `metrics_overhead_ratio` = on / off. The modes alternate in blocks of a few steps, so a drift of
the machine's speed during the run falls on each of them alike; each rate is the median over its
blocks (solo blocks have the same length), and the mean over all timed steps is reported beside
it, with the speed-up and efficiency those means give.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
from pathlib import Path

from hetrain.bench.args import whole
from hetrain.errors import HetrainError
from hetrain.launch.launcher import JobStopped, LaunchConfig, launch
from hetrain.runtime.speeds import parse_speeds


def add_job_options(parser: argparse.ArgumentParser, steps: int = 100) -> None:
    parser.add_argument("--speeds", default="1,0.5", help="emulated speed per rank, e.g. 1,0.5")
    parser.add_argument("--steps", type=whole(1), default=steps, help="training steps per mode")
    parser.add_argument("--warmup", type=whole(0), default=10, help="steps per mode not timed")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=int, default=512,
                        help="samples per step, split over the ranks")
    parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn", help="a small CNN, or an MLP")
    parser.add_argument("--hidden", type=whole(1), default=64, help="CNN channels or MLP width")
    parser.add_argument("--interval", type=whole(1), default=5, help="balancer interval in steps")
    parser.add_argument("--metrics", action="store_true",
                        help="also time hetrain with its Prometheus metrics on (metrics_overhead_ratio)")


def run_job(args: argparse.Namespace, *, progress: bool, schedule: str,
            phases: str = "solo,uniform,balanced") -> dict:
    """Launch the 3-phase job on one rank per speed and return rank 0's figures."""
    speeds = parse_speeds(args.speeds, "--speeds")
    if args.global_batch < len(speeds):
        raise HetrainError(f"global batch {args.global_batch} is smaller than the number of ranks "
                           f"({len(speeds)}); use a global batch of at least {len(speeds)}")
    if args.steps <= args.warmup:
        raise HetrainError(f"--steps {args.steps} must be larger than --warmup {args.warmup}")
    with tempfile.TemporaryDirectory(prefix="hetrain-bench-") as tmp:
        out = Path(tmp) / "result.json"
        job_args = ["--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--global-batch-size", str(args.global_batch), "--model", args.model, "--hidden", str(args.hidden),
                    "--interval", str(args.interval), "--phases", phases, "--schedule", schedule,
                    "--out", str(out)]
        if progress:
            job_args.append("--progress")
        if getattr(args, "outside_load", None) is not None:
            job_args += ["--outside-load", str(args.outside_load)]
        if "metrics" in phases.split(","):
            from hetrain.metrics.serve import free_base_port

            job_args += ["--metrics-port", str(free_base_port(len(speeds)))]
        try:
            launch(LaunchConfig(script="hetrain.bench.balance_job", module=True, script_args=job_args,
                                nproc_per_node=len(speeds), emulate_speeds=speeds))
        except JobStopped as e:   # Ctrl-C: "interrupted", not a user job's advice on checkpoints and SIGTERM
            if e.exit_code == 128 + signal.SIGINT:
                raise KeyboardInterrupt from None
            raise
        return json.loads(out.read_text())


def build_parser(parser: argparse.ArgumentParser) -> None:
    add_job_options(parser)
    parser.add_argument("--outside-load", type=whole(0), default=None, metavar="SEED",
                        help="hetrain alone, ranks pinned one per core, seeded bursts of outside load on "
                             "rank 0's core: how often the split follows load that is not the device "
                             "(use with --speeds 1,1 --steps 300 --interval 10)")


def outside_load(args: argparse.Namespace) -> dict:
    """hetrain alone under bursts of outside load: its split changes, and how far each later one
    lies from an even split."""
    r = run_job(args, progress=False, schedule="sequential", phases="balanced")
    changes = r["balanced"].get("split_changes", [])
    even = args.global_batch / len(r["speeds"])
    later = changes[1:]
    return {
        "speeds": r["speeds"],
        "emulated": r["emulated"],
        "outside_load_seed": args.outside_load,
        "pinned": r.get("pinned"),
        "steps": args.steps,
        "interval": args.interval,
        "split_changes": changes,
        "changes_after_first": len(later),
        "max_off_even_after_first": max((max(abs(n - even) for n in c["new"]) / even for c in later), default=0.0),
        "final_shares": r["balanced"]["shares"],
        "compute_ms_median_p90": r["balanced"]["compute_ms_median_p90"],
    }


def run(args: argparse.Namespace) -> dict:
    if args.outside_load is not None:
        if args.metrics:   # it runs hetrain alone: there is no balanced mode to hold metrics-on against
            raise HetrainError("--metrics cannot be used with --outside-load (which runs hetrain alone, with "
                               "nothing to compare metrics on against); drop one of them")
        return outside_load(args)
    # nothing to emulate: DDP without the hook runs too
    plain = all(s == 1 for s in parse_speeds(args.speeds, "--speeds"))
    phases = "solo,uniform,balanced" + (",metrics" if args.metrics else "") + (",ddp" if plain else "")
    r = run_job(args, progress=False, schedule="interleaved", phases=phases)
    uniform, balanced = r["uniform"]["samples_per_s"], r["balanced"]["samples_per_s"]
    ideal = sum(r["solo_samples_per_s"])
    return {
        "speeds": r["speeds"],
        "emulated": r["emulated"],
        "global_batch_size": r["global_batch_size"],
        "timed_steps": r["timed_steps"],
        "uniform_samples_per_s": uniform,
        "balanced_samples_per_s": balanced,
        "ideal_samples_per_s": ideal,
        "speedup": balanced / uniform,
        "efficiency": balanced / ideal,
        "uniform_mean_samples_per_s": r["uniform"]["mean_samples_per_s"],
        "balanced_mean_samples_per_s": r["balanced"]["mean_samples_per_s"],
        "ideal_mean_samples_per_s": sum(r["solo_mean_samples_per_s"]),
        "mean_speedup": r["balanced"]["mean_samples_per_s"] / r["uniform"]["mean_samples_per_s"],
        "mean_efficiency": r["balanced"]["mean_samples_per_s"] / sum(r["solo_mean_samples_per_s"]),
        "balanced_shares": r["balanced"]["shares"],
        "split_changes": r["balanced"].get("split_changes", []),
        "uniform_idle_fraction": r["uniform"]["idle_fraction"],
        "balanced_idle_fraction": r["balanced"]["idle_fraction"],
        "solo_samples_per_s": r["solo_samples_per_s"],
        **({"metrics_samples_per_s": r["metrics"]["samples_per_s"],
            "metrics_overhead_ratio": r["metrics"]["samples_per_s"] / balanced,
            "metrics_mean_overhead_ratio": r["metrics"]["mean_samples_per_s"] / r["balanced"]["mean_samples_per_s"]}
           if "metrics" in r else {}),
        **({"ddp_samples_per_s": r["ddp"]["samples_per_s"],
            "balanced_over_ddp": balanced / r["ddp"]["samples_per_s"],
            "uniform_over_ddp": uniform / r["ddp"]["samples_per_s"]} if "ddp" in r else {}),
    }

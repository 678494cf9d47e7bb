"""`hetrain bench predict`: does a plan made from a measured profile predict the job it plans?

End to end on this machine's CPU: profile the benchmark's model (hetrain profile's measurement: N
copies at once with the threads each rank will get, as N ranks share the CPU), plan the job for N
CPU ranks from that profile, run the plan with `hetrain launch --plan` on N CPU ranks, and compare
the plan's predicted step time with the measured median step time. A round is profile, plan, run;
the rounds run back to back so that outside load on a shared machine falls on profile and job
alike, and `predicted_over_measured` is the median of the rounds' ratios (each round's is listed).
On a machine others load too, wall time swings with their load; `cpu_predicted_over_measured`
makes the same comparison in process CPU seconds (the plan from the profile's CPU seconds against
rank 0's CPU seconds per step), which that load does not change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from hetrain.bench.args import whole, wholes
from hetrain.errors import HetrainError
from hetrain.hardware.catalog import rank_threads


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=whole(1), default=2, help="CPU ranks of the planned job")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch_size", type=whole(1), default=1024,
                        help="samples per step of the planned job")
    parser.add_argument("--width", type=whole(1), default=64, help="channels of the benchmark's small CNN")
    parser.add_argument("--steps", type=whole(1), default=20, help="steps the job runs")
    parser.add_argument("--warmup", type=whole(0), default=5, help="first steps not timed")
    parser.add_argument("--micro-batches", type=wholes(1), default=[32, 128, 512],
                        help="micro-batch sizes the profile times, comma-separated (default 32,128,512)")
    parser.add_argument("--rounds", type=whole(1), default=5,
                        help="profile-plan-run rounds (their median ratio counts: for an even count, the mean of the "
                             "two middle ones)")


def _profile(args: argparse.Namespace, directory: Path, threads: int):
    import torch

    from hetrain.bench.digits import digits_cnn
    from hetrain.workload import profile
    from hetrain.workload.device_profile import WORKLOAD_FILE
    from hetrain.workload.measure import measure_cpu_copies
    from hetrain.workload.modules import RunnableModel

    sizes = sorted(set(args.micro_batches))
    runnable = RunnableModel("digits-cnn", digits_cnn(args.width), lambda n: torch.randn(n, 64), "cnn")
    workload = profile(runnable.module, runnable.make_input(8), name="digits-cnn", kind="cnn")
    workload.save(directory / WORKLOAD_FILE)
    prof = measure_cpu_copies(runnable, args.ranks, threads, ["fp32"], sizes, repeats=15, budget_s=3.0,
                              workload=workload)
    prof.save(directory)
    return workload, prof


def _round(args: argparse.Namespace, tmp: Path, threads: int) -> tuple:
    """Profile, plan and run once: (plan, plan from CPU seconds, profile, step wall and CPU seconds)."""
    from hetrain.hardware.cluster import cluster_from_devices
    from hetrain.launch.launcher import LaunchConfig, launch
    from hetrain.planning.planner import plan_job

    workload, prof = _profile(args, tmp, threads)
    cluster = cluster_from_devices(f"cpu:{args.ranks}")
    result = plan_job(cluster, workload, args.global_batch_size, profiles={prof.device: prof})
    cpu_result = plan_job(cluster, workload, args.global_batch_size, profiles={prof.device: prof.cpu_time_view()})
    plan_path = tmp / "plan.json"
    result.plan.save(plan_path)
    out = tmp / "steps.json"
    rc = launch(LaunchConfig(script="hetrain.bench.predict_job", module=True, nproc_per_node=args.ranks,
                             plan=str(plan_path), script_args=["--steps", str(args.steps), "--global-batch-size",
                                                               str(args.global_batch_size), "--width", str(args.width),
                                                               "--out", str(out)]))
    if rc != 0 or not out.is_file():
        raise HetrainError(f"the planned job on {args.ranks} CPU ranks failed (exit status {rc}); its ranks' "
                           "errors are printed above")
    steps = json.loads(out.read_text())
    return result, cpu_result, prof, steps["step_seconds"][args.warmup:], steps["step_cpu_seconds"][args.warmup:]


def run(args: argparse.Namespace) -> dict:
    if args.ranks < 1 or args.steps <= args.warmup or args.global_batch_size < args.ranks or args.rounds < 1:
        raise HetrainError("need --ranks >= 1, --rounds >= 1, --steps > --warmup and --global-batch-size >= --ranks")
    threads = rank_threads(args.ranks)
    load_before = os.getloadavg()[0]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="hetrain-predict-") as tmp:
        for _ in range(args.rounds):
            result, cpu_result, prof, timed, cpu_timed = _round(args, Path(tmp), threads)
            predicted = args.global_batch_size / result.plan.predicted_samples_per_s
            cpu_predicted = args.global_batch_size / cpu_result.plan.predicted_samples_per_s
            rounds.append((predicted, statistics.median(timed), statistics.fmean(timed), result, prof,
                           cpu_predicted / statistics.median(cpu_timed)))
    ratios = [p / m for p, m, *_ in rounds]
    cpu_ratios = [r[-1] for r in rounds]
    mid = sorted(range(len(rounds)), key=lambda i: ratios[i])[len(rounds) // 2]
    predicted, measured, mean, result, prof, _ = rounds[mid]
    return {
        "model": "digits-cnn",
        "device": prof.device,
        "ranks": args.ranks,
        "threads_per_rank": threads,
        "global_batch_size": args.global_batch_size,
        "strategy": result.plan.strategy,
        "shares": [r.share for r in result.plan.ranks],
        "figures": result.figures,
        "profile_micro_batches": [s.micro_batch for s in prof.steps],
        "profile_seconds": [round(s.seconds, 6) for s in prof.steps],
        "optimizer_seconds": round(prof.optimizer_seconds, 6),
        "predicted_step_seconds": round(predicted, 6),
        "measured_step_seconds": round(measured, 6),
        "measured_mean_step_seconds": round(mean, 6),
        "timed_steps_per_round": args.steps - args.warmup,
        "rounds": args.rounds,
        "round_predicted_over_measured": [round(r, 4) for r in ratios],
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "round_cpu_predicted_over_measured": [round(r, 4) for r in cpu_ratios],
        "cpu_predicted_over_measured": round(statistics.median(cpu_ratios), 4),
        "predicted_over_measured": round(ratios[mid], 4),
        "emulated": False,   # measured on this machine's CPU, profile and job alike
    }

"""`hetrain bench data`: plain DDP with DataLoader workers against hetrain's loader, on decoded images.

One job on 2 ranks (hetrain/bench/data_job.py) measures, in one run: plain DDP (DistributedSampler
and DataLoader with W workers) and hetrain's loader with the same workers at speeds 1,1 and at
emulated speeds 1,0.5; then one rank's input pipeline slowed (fewer workers) with hetrain's split
held even and balanced. The two modes of each comparison alternate timed blocks of steps, and each
rate is the median over its blocks. Figures are ratios measured in the same run:
`equal_speed_ratio` = hetrain / plain DDP at 1,1; `speedup` = hetrain / plain DDP at 1,0.5;
`slow_loader_speedup` = hetrain balanced / even split with one rank's loader slowed. The device is
emulated: the CNN runs on the CPU, and each rank then waits `--device-ms` per sample over its speed,
leaving the CPU cores to the input pipeline as a GPU host does (hetrain/bench/emulated_device.py).
Beside them: `shares_*`, the split of the last batch handed out, which trails a re-split by the
loader's prefetch depth, and `balancer_shares_*`, the balancer's final split; and
`data_wait_ms_per_step_slow_loader_*`, each rank's mean wait for its batch over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hetrain.bench.args import number, whole
from hetrain.errors import HetrainError
from hetrain.launch.launcher import LaunchConfig, launch


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=whole(0), default=2, help="DataLoader workers per rank")
    parser.add_argument("--slow-workers", type=whole(0), default=0, help="workers of the rank whose loader is slowed")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=whole(2), default=64,
                        help="samples per step, split over the ranks")
    parser.add_argument("--samples", type=whole(2), default=1024, help="images in the dataset")
    parser.add_argument("--steps", type=whole(1), default=40, help="timed steps per mode")
    parser.add_argument("--warmup", type=whole(0), default=40, help="untimed steps per mode (the balancer settles)")
    parser.add_argument("--block", type=whole(1), default=4, help="steps per timed block; the modes compared alternate")
    parser.add_argument("--width", type=whole(1), default=16, help="CNN channels")
    parser.add_argument("--device-ms", type=number(least=0), default=1.0,
                        help="emulated device milliseconds per sample (forward and backward) at speed 1")
    parser.add_argument("--interval", type=whole(1), default=5, help="balancer interval in steps")


def run(args: argparse.Namespace) -> dict:
    if args.slow_workers >= args.workers:
        raise HetrainError(f"--slow-workers {args.slow_workers} must be fewer than --workers {args.workers} "
                           "(the slowed rank reads with fewer workers)")
    if args.global_batch < 2 or args.samples < args.global_batch:
        raise HetrainError(f"--samples {args.samples} must hold one global batch of {args.global_batch} (>= 2)")
    with tempfile.TemporaryDirectory(prefix="hetrain-bench-data-") as tmp:
        out = Path(tmp) / "result.json"
        job_args = ["--workers", str(args.workers), "--slow-workers", str(args.slow_workers),
                    "--global-batch", str(args.global_batch), "--samples", str(args.samples),
                    "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width), "--device-ms", str(args.device_ms),
                    "--interval", str(args.interval), "--block", str(args.block), "--out", str(out)]
        launch(LaunchConfig(script="hetrain.bench.data_job", module=True, script_args=job_args, nproc_per_node=2))
        r = json.loads(out.read_text())
    rate = {k: r[k]["samples_per_s"] for k in ("ddp_1_1", "hetrain_1_1", "ddp_1_0.5", "hetrain_1_0.5",
                                                "slow_loader_even", "slow_loader_hetrain")}
    return {
        "emulated": True,
        "world_size": r["world_size"],
        "global_batch_size": r["global_batch_size"],
        "workers": r["workers"],
        "slow_workers": r["slow_workers"],
        "timed_steps": r["timed_steps"],
        "decode_ms_per_sample": r["decode_ms_per_sample"],
        "device_ms_per_sample": r["device_ms_per_sample"],
        "ddp_samples_per_s_1_1": rate["ddp_1_1"],
        "hetrain_samples_per_s_1_1": rate["hetrain_1_1"],
        "ddp_samples_per_s_1_0.5": rate["ddp_1_0.5"],
        "hetrain_samples_per_s_1_0.5": rate["hetrain_1_0.5"],
        "slow_loader_even_samples_per_s": rate["slow_loader_even"],
        "slow_loader_hetrain_samples_per_s": rate["slow_loader_hetrain"],
        "equal_speed_ratio": rate["hetrain_1_1"] / rate["ddp_1_1"],
        "speedup": rate["hetrain_1_0.5"] / rate["ddp_1_0.5"],
        "slow_loader_speedup": rate["slow_loader_hetrain"] / rate["slow_loader_even"],
        # the balancer's final split, and the split of the last batch the loader handed out, which trails
        # it by the loader's prefetch depth (a re-split reaches the batches a few steps later)
        "balancer_shares_1_1": r["hetrain_1_1"]["balancer_shares"],
        "balancer_shares_1_0.5": r["hetrain_1_0.5"]["balancer_shares"],
        "balancer_shares_slow_loader": r["slow_loader_hetrain"]["balancer_shares"],
        "shares_1_1": r["hetrain_1_1"]["loader_shares"],
        "shares_1_0.5": r["hetrain_1_0.5"]["loader_shares"],
        "shares_slow_loader": r["slow_loader_hetrain"]["loader_shares"],
        "split_changes_slow_loader": r["slow_loader_hetrain"]["split_changes"],
        "data_wait_ms_per_step_slow_loader_even": r["slow_loader_even"]["data_wait_ms_per_step"],
        "data_wait_ms_per_step_slow_loader_hetrain": r["slow_loader_hetrain"]["data_wait_ms_per_step"],
    }

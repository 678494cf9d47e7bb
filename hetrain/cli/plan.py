"""`hetrain plan`: choose per-device shares, precision, memory strategy and compression."""

from __future__ import annotations

import argparse
import json
import math
import sys

from hetrain.cli.console import print_rows, stdout_console
from hetrain.errors import HetrainError
from hetrain.userfiles import check_writable_file, read_text
from hetrain.planning.compression_choice import COMPRESSION_CHOICES
from hetrain.planning.planner import STRATEGIES
from hetrain.planning.precision_policy import PRECISION_CHOICES
from hetrain.vocabulary import OPTIMIZERS

MAX_GLOBAL_BATCH = 2**53   # samples per step the planner counts exactly (a float holds them)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """--cluster FILE | --preset NAME | --devices MODEL:COUNT,... (exactly one)."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--cluster", metavar="FILE", help="cluster file (YAML)")
    group.add_argument("--preset", metavar="NAME", help="a named cluster: a100x8, v100x8, a100x4+v100x4, mix1024")
    group.add_argument("--devices", metavar="MODEL:COUNT,...", help="devices on one node, e.g. a100:4,v100:4")


def cluster_from_args(args: argparse.Namespace):
    """The Cluster the arguments name."""
    from hetrain.hardware.cluster import cluster_from_devices, get_preset, load_cluster

    if args.cluster:
        cluster = load_cluster(args.cluster)
    elif args.preset:
        cluster = get_preset(args.preset)
    else:
        cluster = cluster_from_devices(args.devices)
    if cluster.size == 0:
        raise HetrainError("the cluster has no devices; list at least one device")
    return cluster


def profile_from_args(args: argparse.Namespace):
    """The workload profile: a zoo model by name, a saved profile file, or the one beside --profiles."""
    from pathlib import Path

    from hetrain.workload import WorkloadProfile, get_profile
    from hetrain.workload.device_profile import WORKLOAD_FILE

    if args.profile:
        read_text(args.profile, "profile file")   # a missing, binary or oversized file: one line
        return WorkloadProfile.load(args.profile)
    if args.model:
        return get_profile(args.model, "pass --profile FILE (a saved profile) or --profiles DIR (written by "
                                       "hetrain profile)")
    if getattr(args, "profiles", None):
        beside = Path(args.profiles) / WORKLOAD_FILE
        if not Path(args.profiles).is_dir():
            raise HetrainError(f"--profiles {args.profiles}: no such directory; give the --out DIR of hetrain profile")
        if not beside.is_file():
            raise HetrainError(f"--profiles {args.profiles}: no {WORKLOAD_FILE} there; profile into it with "
                               "hetrain profile --model NAME --out DIR, or name the model with --model")
        return WorkloadProfile.load(beside)
    raise HetrainError("name the model: --model NAME, --profile FILE, or --profiles DIR written by hetrain profile")


def add_global_batch_arg(parser: argparse.ArgumentParser, **kwargs) -> None:
    """--global-batch-size N (--global-batch is the same flag)."""
    kwargs.setdefault("help", "samples per optimizer step")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch_size", type=int, **kwargs)


def build_parser(parser: argparse.ArgumentParser) -> None:
    add_cluster_args(parser)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="reference model: resnet50, resnet152, bert-base, bert-large, "
                       "bert-large-512, gpt2-124m, gpt2-1.5b, gpt3-2.7b, llama-7b, ...")
    model.add_argument("--profile", metavar="FILE", help="profile saved by hetrain.workload.profile(...).save()")
    add_global_batch_arg(parser, help="samples per optimizer step (required; with --from-run, the run's by default)")
    parser.add_argument("--profiles", metavar="DIR", help="measured device profiles written by hetrain profile --out DIR; "
                        "their figures replace the model's for the device kinds they cover")
    parser.add_argument("--from-run", metavar="DIR", help="re-plan with the per-device-kind rates a run measured "
                        "(measured-rates.json in its run or checkpoint directory)")
    parser.add_argument("--strategy", default="auto", choices=list(STRATEGIES),
                        help="auto (the default) compares the strategies and says why it chose one; "
                             "another forces that strategy")
    parser.add_argument("--precision", default="auto", choices=list(PRECISION_CHOICES),
                        help="auto: bf16 where the chip has it, fp16 with loss scaling elsewhere; "
                             "another forces that precision where the chip has it")
    parser.add_argument("--micro-batch", type=int, default=None, metavar="N",
                        help="the largest micro-batch on every device: shares run in equal pieces of at most N "
                             "(with activation checkpointing where a device needs it to hold N); a device that "
                             "cannot hold N runs as without the flag, and a note says so")
    parser.add_argument("--compression", default="auto", choices=list(COMPRESSION_CHOICES),
                        help="gradient compression of the all-reduce (DDP and ZeRO-1): auto (the default) sends fp32, "
                             "or a 16-bit all-reduce where the all-reduce across nodes is the bottleneck; powersgd, int8 "
                             "and topk carry part of each gradient to later steps (the update differs from one "
                             "process's) and run only when named here")
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                        help="the optimizer whose state and step the plan prices: torch.optim's AdamW, Adam "
                             "and SGD (with momentum) as constructed by default, or with fused=True (-fused)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", metavar="PLAN.json", help="write the Plan document here")


def rank_label(ranks: list[int]) -> str:
    """`3`, `0..5 (6)` for consecutive ranks, `0,1,4,5` otherwise (the first eight, then a count)."""
    if len(ranks) == 1:
        return str(ranks[0])
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
    shown = ",".join(map(str, ranks[:8]))
    return shown if len(ranks) <= 8 else f"{shown},... ({len(ranks)})"


def run(args: argparse.Namespace) -> int:
    from hetrain.planning.measured_rates import MeasuredRates
    from hetrain.planning.planner import plan_job
    from hetrain.workload.device_profile import load_profiles

    # what the user named first is checked first: an unknown preset or model is reported as such,
    # not hidden behind a missing batch size
    cluster, profile = cluster_from_args(args), profile_from_args(args)
    rates = MeasuredRates.load(args.from_run) if args.from_run else None
    if rates is not None:
        rates.check_model(profile.params, profile.name, args.from_run)
    if args.global_batch_size is None:
        if rates is None:
            raise HetrainError("--global-batch-size is required (samples per optimizer step), e.g. --global-batch-size 256")
        args.global_batch_size = rates.global_batch_size  # re-plan the run's job
    if not 1 <= args.global_batch_size <= MAX_GLOBAL_BATCH:
        raise HetrainError(f"--global-batch-size must be a positive integer up to {MAX_GLOBAL_BATCH:,}, got "
                           f"{args.global_batch_size:,}")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise HetrainError(f"--micro-batch must be a positive integer, got {args.micro_batch}")
    skipped: list[str] = []
    profiles = load_profiles(args.profiles, skipped) if args.profiles else None
    for line in skipped:   # a plan saved beside the profiles (--out DIR/plan.json) is not one of them
        print(f"hetrain plan: note: {line}", file=sys.stderr, flush=True)
    from rich.console import Console

    # weighing pipelines can take a second on large clusters: a spinner on a terminal's stderr, nothing elsewhere
    with Console(stderr=True).status("weighing strategies, shares and partitions..."):
        result = plan_job(cluster, profile, args.global_batch_size,
                          optimizer=args.optimizer, strategy=args.strategy, precision=args.precision,
                          micro_batch=args.micro_batch, profiles=profiles, rates=rates,
                          compression=args.compression)
    if args.out:
        check_writable_file(args.out, "--out")
        result.plan.save(args.out)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print_result(result)
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def print_result(result) -> None:
    """Rich tables: one row per device (identical rows folded), then the candidates."""
    console = stdout_console()
    plan = result.plan
    cells: list[list[str]] = []
    rows: dict[tuple, list[int]] = {}
    for r in plan.ranks:
        key = (r.device, r.precision, r.share, r.micro_batch, r.grad_accum, r.memory_bytes, r.memory_capacity_bytes,
               r.activation_checkpointing, r.stage, r.predicted_step_seconds)
        rows.setdefault(key, []).append(r.rank)
    for key, ranks in rows.items():
        dev, prec, share, mb, acc, mem, cap, ckpt, stage, t = key
        label = rank_label(ranks)
        # the pieces this share runs in (a data-parallel entry's micro_batch is the largest its device holds)
        pieces = (f"{math.ceil(share / acc)} x {acc}" if share else "-") if plan.pipeline is None else f"{mb} x {acc}"
        cells.append([label, dev, prec, str(share), pieces, f"{(mem or 0) / 1e9:.1f} / {(cap or 0) / 1e9:.1f} GB",
                      "yes" if ckpt else "no", str(stage), f"{t:.3f}" if t is not None else "-",
                      result.figures.get(dev, "modelled")])
    print_rows(console, ["ranks", "device", "precision", "share", "micro-batch x accum", "memory used / total",
                         "checkpointing", "stage", "compute (s)", "figures"], cells,
               title=f"hetrain plan: {plan.strategy}, global batch {plan.global_batch_size}")
    print_rows(console, ["strategy", "samples/s", "compression", "why"],
               [[c.strategy, f"{c.samples_per_s:.1f}" if c.feasible else "-", c.compression, c.reason]
                for c in result.candidates], title="candidates")
    uniform = f"{result.uniform_ddp_samples_per_s:.1f}" if result.uniform_ddp_samples_per_s else "does not fit"
    console.print(f"predicted {plan.predicted_samples_per_s:.1f} samples/s; uniform DDP {uniform}; "
                  f"ideal (sum of devices alone) {result.ideal_samples_per_s:.1f}")
    for note in plan.notes:
        console.print(f"- {note}")

"""`hetrain bench comm`: bytes per step, step time, hidden communication and accuracy of each hook.

Plain DistributedDataParallel on CPU ranks over gloo trains an MLP (64-512-512-512-10, every hidden
layer at least 256x256) on scikit-learn's digits (fixed seed, fixed 80/20 split) for a fixed
number of steps once per compression, with the same data and initial weights, and reports for each
hook the bytes a rank sends per step and their ratio to uncompressed, the step time, the hidden
fraction of communication (docs/communication.md) and the test accuracy reached.
"""

from __future__ import annotations

import argparse

from hetrain.bench.args import number, whole
from hetrain.errors import HetrainError
from hetrain.vocabulary import COMPRESSIONS

HOOKS = list(COMPRESSIONS)
TARGET_RATIO = {"powersgd": 0.10, "int8": 0.27, "topk": 0.03}  # on 2 ranks
WIDTH = 512


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=whole(2), default=2, help="CPU ranks (gloo)")
    parser.add_argument("--steps", type=whole(1), default=500, help="optimizer steps per hook")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch_size", type=whole(2), default=64,
                        help="samples per step, split evenly over the ranks")
    parser.add_argument("--lr", type=number(above=0), default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--hooks", default=",".join(HOOKS), help="comma-separated compressions")
    parser.add_argument("--powersgd-rank", type=whole(1), default=2, help="rank of PowerSGD's low-rank factors")
    parser.add_argument("--powersgd-warmup-steps", type=whole(0), default=10,
                        help="steps PowerSGD sends uncompressed before it compresses")
    parser.add_argument("--topk-ratio", type=number(above=0, most=1), default=0.01,
                        help="share of the gradient's entries topk sends (the largest)")
    parser.add_argument("--bucket-cap-mb", type=number(above=0), default=0.25, help="DDP bucket size (several buckets overlap)")
    parser.add_argument("--islands", type=island_text, default=None,
                        help="two-level all-reduce over islands of ranks, e.g. '0,1;2,3' (every rank once)")
    parser.add_argument("--seed", type=whole(0), default=0,
                        help="seed of the train/test split, the initial weights and the batches")


def parse_islands(text: str) -> list[list[int]]:
    """'0,1;2,3' -> [[0, 1], [2, 3]]: islands split by ';', the ranks of each by ','."""
    return [[int(r) for r in part.split(",")] for part in text.split(";")]


def island_text(text: str) -> str:
    """--islands' argparse type: the text, once it reads as islands of whole numbers."""
    try:
        parse_islands(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not islands of ranks; write the ranks of each island comma-separated and the islands "
            "separated by ';', e.g. '0,1;2,3'") from None
    return text


def check_islands(text: str | None, ranks: int) -> None:
    """Refuse islands that do not name each of the ``ranks`` ranks exactly once, before any rank starts."""
    if text is None:
        return
    islands = parse_islands(text)
    if sorted(r for island in islands for r in island) != list(range(ranks)):
        half = max(1, ranks // 2)
        example = ",".join(map(str, range(half))) + ";" + ",".join(map(str, range(half, ranks)))
        raise HetrainError(f"--islands {text!r} must name every rank 0..{ranks - 1} of --ranks {ranks} exactly "
                           f"once; fix the islands to match the rank count, e.g. --islands '{example}'")


def run(args: argparse.Namespace) -> dict:
    """Train once per hook on ``args.ranks`` CPU ranks; figures per hook and against ``none``."""
    hooks = args.hooks.split(",")
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown or "none" not in hooks:
        raise HetrainError(f"--hooks {args.hooks}: give compressions from {HOOKS}, including 'none' (the baseline)")
    if args.ranks < 1 or args.global_batch_size % args.ranks:
        raise HetrainError(
            f"--ranks {args.ranks} with --global-batch-size {args.global_batch_size}: the batch must split evenly; "
            "pick a batch size divisible by the rank count"
        )
    check_islands(args.islands, args.ranks)
    if args.powersgd_warmup_steps < 0 or args.steps <= args.powersgd_warmup_steps:
        raise HetrainError(
            f"--steps {args.steps} must be larger than --powersgd-warmup-steps {args.powersgd_warmup_steps} "
            "(>= 0): the figures after warm-up are taken on the steps after it"
        )
    from hetrain.bench.comm_job import measure   # torch: after the flags are checked

    per_hook, wall, params = measure(args)
    base = per_hook["none"]
    for name, r in per_hook.items():
        r["ratio_to_none"] = r["bytes_per_step"] / base["bytes_per_step"]
        r["ratio_after_warmup"] = r["bytes_per_step_after_warmup"] / base["bytes_per_step_after_warmup"]
        r["step_time_ratio"] = r["step_s"] / base["step_s"]
        r["accuracy_delta_pp"] = 100.0 * (r["test_accuracy"] - base["test_accuracy"])
    checks = {}
    if args.ranks == 2 and not args.islands:
        for name, limit in TARGET_RATIO.items():
            if name in per_hook:
                checks[f"{name}_ratio_le_{limit}"] = per_hook[name]["ratio_to_none"] <= limit
    for name, r in per_hook.items():
        if name != "none":
            checks[f"{name}_accuracy_within_1pp"] = r["accuracy_delta_pp"] >= -1.0
    return {
        "ranks": args.ranks,
        "steps": args.steps,
        "global_batch_size": args.global_batch_size,
        "model": f"mlp 64-{WIDTH}-{WIDTH}-{WIDTH}-10 ({params} parameters), digits 80/20 split, seed {args.seed}",
        "islands": args.islands,
        "hooks": per_hook,
        "checks": checks,
        "wall_s": wall,
        "emulated": False,
    }

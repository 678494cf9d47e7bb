"""`hetrain bench pipeline`: the planner's uneven layer partition against an even one and against
data parallelism, on CPU ranks at emulated speeds (default 1, 0.5, 0.5), in one run.

Figures (one JSON object): `uneven_over_even` = even / uneven step time (and `uneven_over_even_ideal`,
the same ratio for stages with no transfer or overhead); `dp_over_uneven` = data
parallel / uneven step time; `bubble_measured` = 1 - busy / schedule time of the uneven pipeline's
busiest stage (the run of `forward_backward`; the optimizer step and data are outside it), against `bubble_predicted` = (p-1)/(m+p-1), and `bubble_error_pp` their difference in
percentage points; `predicted_over_measured` = the planner's predicted step time of the uneven
pipeline ((m+p-1) slots of its slowest stage) over the measured one. Compute is emulated (each
block waits in proportion to its samples over the rank's speed), so the figures are emulated.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hetrain.errors import HetrainError
from hetrain.planning import cost_model as cm
from hetrain.planning.batch_split import split_proportional
from hetrain.planning.partition import partition_blocks
from hetrain.planning.plan import BalancePlan, PipelinePlan, Plan, RankPlan
from hetrain.planning.planner import pipeline_bubble
from hetrain.runtime.timing import parse_speeds


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speeds", default="1,0.5,0.5", help="emulated speed per rank (one stage each)")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of the model (>= ranks)")
    parser.add_argument("--block-ms", type=float, default=1.0,
                        help="forward milliseconds per sample per block at speed 1 (backward takes twice that)")
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--microbatches", type=int, default=24,
                        help="micro-batches per step (the bubble (p-1)/(m+p-1) shrinks as they grow)")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--steps", type=int, default=5, help="steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="steps per plan not timed")


def stage_seconds(bounds: list[tuple[int, int]], speeds: list[float], block_ms: float, micro: int) -> list[float]:
    """Forward and backward seconds of one micro-batch on each stage."""
    return [(b - a) * 3.0 * block_ms / 1000.0 * micro / s for (a, b), s in zip(bounds, speeds)]


def uneven_partition(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The planner's layer partition (its dynamic programme) for these stage speeds."""
    micro = args.global_batch // args.microbatches
    found = partition_blocks(args.blocks, len(args.speeds),
                             lambda j, a, b: stage_seconds([(a, b)], [args.speeds[j]], args.block_ms, micro)[0])
    assert found is not None
    return found[0]


def even_partition(blocks: int, stages: int) -> list[tuple[int, int]]:
    cuts = [round(i * blocks / stages) for i in range(stages + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _pipeline(bounds: list[tuple[int, int]], args: argparse.Namespace) -> Plan:
    ranks = [RankPlan(rank=j, share=args.global_batch, stage=j) for j in range(len(bounds))]
    return Plan(global_batch_size=args.global_batch, strategy="pipeline", ranks=ranks,
                balance=BalancePlan(enabled=False),
                pipeline=PipelinePlan(stages=[list(b) for b in bounds], schedule=args.schedule,
                                      microbatches=args.microbatches))


def plans(args: argparse.Namespace) -> dict[str, Plan]:
    """The three plans the job runs, by name."""
    shares = split_proportional(args.global_batch, args.speeds)
    dp = Plan(global_batch_size=args.global_batch, strategy="balanced", balance=BalancePlan(enabled=False),
              ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(shares)])
    return {"uneven": _pipeline(uneven_partition(args), args),
            "even": _pipeline(even_partition(args.blocks, len(args.speeds)), args),
            "data_parallel": dp}


def _check(args: argparse.Namespace) -> None:
    p = len(args.speeds)
    if args.blocks < p:
        raise HetrainError(f"--blocks {args.blocks} is fewer than the {p} stages; use at least {p} blocks")
    if args.global_batch % args.microbatches or args.global_batch < args.microbatches:
        raise HetrainError(f"--global-batch {args.global_batch} must be a multiple of --microbatches "
                           f"{args.microbatches}; pick e.g. {args.microbatches * 6}")
    if args.steps <= args.warmup:
        raise HetrainError(f"--steps {args.steps} must be larger than --warmup {args.warmup}")


def run(args: argparse.Namespace) -> dict:
    from hetrain.launch.launcher import LaunchConfig, launch

    args.speeds = parse_speeds(args.speeds)
    _check(args)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    with tempfile.TemporaryDirectory(prefix="hetrain-bench-") as tmp:
        out = Path(tmp) / "result.json"
        launch(LaunchConfig(script="hetrain.bench.pipeline_job", module=True, nproc_per_node=len(args.speeds),
                            script_args=["--config", json.dumps(config), "--out", str(out)]))
        measured = json.loads(out.read_text())
    return figures(args, measured)


def _fill_drain(bounds: list[tuple[int, int]], args: argparse.Namespace) -> float:
    """A GPipe/1F1B step with no transfer or overhead: m - 1 micro-batches on the slowest stage, plus
    one micro-batch through every stage (the cost model's (m + p - 1) slots when stages are equal)."""
    t = stage_seconds(bounds, args.speeds, args.block_ms, args.global_batch // args.microbatches)
    return (args.microbatches - 1) * max(t) + sum(t)


def figures(args: argparse.Namespace, measured: dict) -> dict:
    """The benchmark's JSON object from the job's measurements."""
    p, m = len(args.speeds), args.microbatches
    uneven, even = uneven_partition(args), even_partition(args.blocks, p)
    micro = args.global_batch // m
    predicted_step = cm.pipeline_step_seconds(stage_seconds(uneven, args.speeds, args.block_ms, micro), m)
    step = measured["uneven"]["step_seconds"]
    busy, passes = measured["uneven"]["busy_seconds"], measured["uneven"]["pass_seconds"]
    busiest = max(range(p), key=lambda j: busy[j])
    bubble = 1.0 - busy[busiest] / passes[busiest]   # idle share of the schedule's run on the busiest stage
    predicted_bubble = pipeline_bubble(p, m)
    return {
        "speeds": args.speeds,
        "blocks": args.blocks,
        "microbatches": m,
        "schedule": args.schedule,
        "uneven_stages": [list(b) for b in uneven],
        "even_stages": [list(b) for b in even],
        "step_seconds": {name: round(r["step_seconds"], 5) for name, r in measured.items()},
        "uneven_over_even": measured["even"]["step_seconds"] / step,
        "uneven_over_even_ideal": _fill_drain(even, args) / _fill_drain(uneven, args),
        "dp_over_uneven": measured["data_parallel"]["step_seconds"] / step,
        "bubble_measured": bubble,
        "bubble_predicted": predicted_bubble,
        "bubble_error_pp": abs(bubble - predicted_bubble) * 100.0,
        "predicted_step_seconds": predicted_step,
        "predicted_over_measured": predicted_step / step,
        "emulated": True,
    }

"""`hetrain bench pipeline`: the planner's uneven layer partition against an even one and against
data parallelism, on CPU ranks at emulated speeds (default 1, 0.5, 0.5), in one run.

Figures (one JSON object): `uneven_over_even` = even / uneven step time, the uneven plan's speed over
the even one's (and `uneven_over_even_ideal`, the same ratio for stages with no transfer or overhead,
in the order the schedule runs them); `dp_over_uneven` = data parallel / uneven step time, a ratio of
step times (above 1: the uneven pipeline is faster); `bubble_measured` = 1 - busy / schedule time
of the uneven pipeline's busiest stage (the schedule's time: the longest run of `forward_backward`;
the optimizer step and data are outside it), against `bubble_predicted` = (p-1)/(m+p-1), or (p-1)/(v*m+p-1) for interleaved
1F1B with v chunks per rank, and `bubble_error_pp` their difference in percentage points;
`predicted_over_measured` = the cost model's predicted step time of the uneven pipeline
((m+p-1) slots of its slowest stage, m+(p-1)/v interleaved) over the measured one. Compute is
emulated (each block waits in proportion to its samples over the rank's speed, and its own
compute is slowed as much), so the figures are emulated.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hetrain.bench.args import number, whole
from hetrain.errors import HetrainError
from hetrain.planning import cost_model as cm
from hetrain.planning.batch_split import split_proportional
from hetrain.bench.pipeline_ideal import ideal_step_seconds
from hetrain.planning.cost_model import pipeline_bubble
from hetrain.planning.partition import interleaved_stages, partition_blocks
from hetrain.planning.plan import BalancePlan, PipelinePlan, Plan, RankPlan
from hetrain.planning.pipeline_planner import interleaved_rounds_fit
from hetrain.runtime.speeds import parse_speeds
from hetrain.vocabulary import SCHEDULES


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speeds", default="1,0.5,0.5", help="emulated speed per rank (one stage each)")
    parser.add_argument("--blocks", type=whole(2), default=12, help="blocks of the model (>= ranks)")
    parser.add_argument("--block-ms", type=number(above=0), default=1.0,
                        help="forward milliseconds per sample per block at speed 1 (backward takes twice that)")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=whole(1), default=192,
                        help="samples per step (micro-batches of 4 by default)")
    parser.add_argument("--microbatches", type=whole(1), default=48,
                        help="micro-batches per step (m = 16p: the bubble (p-1)/(m+p-1) is 4%%; it shrinks as m grows)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="the pipeline schedule every plan runs")
    parser.add_argument("--chunks", type=whole(1), default=3,
                        help="stages per rank under interleaved-1f1b (3 cuts the planner's 6, 3, 3 blocks into "
                             "chunks of 2, 1, 1 and the even 4, 4, 4 into 2, 1, 1)")
    parser.add_argument("--steps", type=whole(1), default=8, help="steps per plan (the median of the timed ones counts)")
    parser.add_argument("--warmup", type=whole(0), default=2, help="steps per plan not timed")


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


def chunks_of(args: argparse.Namespace) -> int:
    return args.chunks if args.schedule == "interleaved-1f1b" else 1


def pipeline_stages(bounds: list[tuple[int, int]], args: argparse.Namespace) -> list[tuple[int, int]]:
    """The stages in pipeline order: the partition itself, or each rank's blocks in chunks (interleaved)."""
    v = chunks_of(args)
    return bounds if v == 1 else interleaved_stages([b - a for a, b in bounds], v)


def _pipeline(bounds: list[tuple[int, int]], args: argparse.Namespace) -> Plan:
    ranks = [RankPlan(rank=j, share=args.global_batch, stage=j) for j in range(len(bounds))]
    return Plan(global_batch_size=args.global_batch, strategy="pipeline", ranks=ranks,
                balance=BalancePlan(enabled=False),
                pipeline=PipelinePlan(stages=[list(b) for b in pipeline_stages(bounds, args)], schedule=args.schedule,
                                      microbatches=args.microbatches, chunks=chunks_of(args)))


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
    if args.schedule == "interleaved-1f1b":
        if args.chunks < 2 or args.blocks < p * args.chunks:
            raise HetrainError(f"--chunks {args.chunks}: interleaved-1f1b needs at least 2 chunks per rank and "
                               f"{p} ranks x {args.chunks} chunks <= --blocks {args.blocks}; use e.g. --chunks 2")
        if not interleaved_rounds_fit(args.microbatches, p):
            raise HetrainError(f"--microbatches {args.microbatches}: torch's interleaved 1F1B runs them in rounds of "
                               f"{p} ranks and needs a multiple of {args.microbatches // p}; use e.g. {p * 8}")
        pipeline_stages(uneven_partition(args), args)   # every rank holds at least a block per chunk


def run(args: argparse.Namespace) -> dict:
    from hetrain.launch.launcher import LaunchConfig, launch

    args.speeds = parse_speeds(args.speeds, "--speeds")
    _check(args)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    with tempfile.TemporaryDirectory(prefix="hetrain-bench-") as tmp:
        out = Path(tmp) / "result.json"
        launch(LaunchConfig(script="hetrain.bench.pipeline_job", module=True, nproc_per_node=len(args.speeds),
                            script_args=["--config", json.dumps(config), "--out", str(out)]))
        measured = json.loads(out.read_text())
    return figures(args, measured)


def _ideal(bounds: list[tuple[int, int]], args: argparse.Namespace) -> float:
    """The partition's step on this schedule with no transfer or overhead (see pipeline_ideal)."""
    stages, p = pipeline_stages(bounds, args), len(args.speeds)
    speeds = [args.speeds[s % p] for s in range(len(stages))]
    t = stage_seconds(stages, speeds, args.block_ms, args.global_batch // args.microbatches)
    return ideal_step_seconds(args.schedule, t, args.microbatches, chunks_of(args))


def figures(args: argparse.Namespace, measured: dict) -> dict:
    """The benchmark's JSON object from the job's measurements."""
    p, m, v = len(args.speeds), args.microbatches, chunks_of(args)
    uneven, even = uneven_partition(args), even_partition(args.blocks, p)
    micro = args.global_batch // m
    predicted_step = cm.pipeline_step_seconds(stage_seconds(uneven, args.speeds, args.block_ms, micro), m, chunks=v)
    step = measured["uneven"]["step_seconds"]
    busy, passes = measured["uneven"]["busy_seconds"], measured["uneven"]["pass_seconds"]
    # The idle share of the busiest stage over the schedule's whole run (the longest `forward_backward`:
    # the first stage's, which spans the fill and the drain; later stages return before the drain ends).
    bubble = 1.0 - max(busy) / max(passes)
    predicted_bubble = pipeline_bubble(p, m, v)
    return {
        "speeds": args.speeds,
        "blocks": args.blocks,
        "microbatches": m,
        "schedule": args.schedule,
        "chunks": v,
        "uneven_stages": [list(b) for b in pipeline_stages(uneven, args)],
        "even_stages": [list(b) for b in pipeline_stages(even, args)],
        "step_seconds": {name: round(r["step_seconds"], 5) for name, r in measured.items()},
        "uneven_over_even": measured["even"]["step_seconds"] / step,
        "uneven_over_even_ideal": _ideal(even, args) / _ideal(uneven, args),
        "dp_over_uneven": measured["data_parallel"]["step_seconds"] / step,   # step times: above 1, the pipeline is faster
        "bubble_measured": bubble,
        "bubble_predicted": predicted_bubble,
        "bubble_error_pp": abs(bubble - predicted_bubble) * 100.0,
        "predicted_step_seconds": predicted_step,
        "predicted_over_measured": predicted_step / step,
        "emulated": True,
    }

"""`hetrain bench pipeline`'s decisions: the partitions it compares and the figures it derives."""

import argparse

import pytest

from hetrain.bench.pipeline import build_parser, even_partition, figures, plans, uneven_partition
from hetrain.errors import HetrainError


def _args(*argv, parsed: bool = True):
    parser = argparse.ArgumentParser()
    build_parser(parser)
    args = parser.parse_args(list(argv))
    if parsed:
        args.speeds = [float(s) for s in args.speeds.split(",")]
    return args


def test_the_planner_gives_the_fast_rank_twice_the_blocks():
    args = _args()
    assert uneven_partition(args) == [(0, 6), (6, 9), (9, 12)]
    assert even_partition(12, 3) == [(0, 4), (4, 8), (8, 12)]
    made = plans(args)
    assert made["uneven"].pipeline.stages == [[0, 6], [6, 9], [9, 12]]
    assert made["data_parallel"].shares == [96, 48, 48]


def test_figures_from_measurements():
    args = _args("--microbatches", "8", "--global-batch", "48", "--block-ms", "1")
    measured = {"uneven": {"step_seconds": 1.3, "busy_seconds": [0.9, 0.96, 0.95], "pass_seconds": [1.2, 1.2, 1.2]},
                "even": {"step_seconds": 1.5, "busy_seconds": [0.4, 1.2, 1.2], "pass_seconds": [1.4] * 3},
                "data_parallel": {"step_seconds": 0.9, "busy_seconds": [0.8] * 3, "pass_seconds": [0.85] * 3}}
    out = figures(args, measured)
    assert out["uneven_over_even"] == pytest.approx(1.5 / 1.3)
    # a ratio of step times: data parallel (0.9 s) over the uneven pipeline (1.3 s)
    assert out["dp_over_uneven"] == pytest.approx(0.9 / 1.3)
    # even: 7 x 144 ms (4 blocks at speed 0.5) + 72 + 144 + 144; uneven: 10 x 108 ms
    assert out["uneven_over_even_ideal"] == pytest.approx((7 * 0.144 + 0.36) / 1.08)
    assert out["bubble_predicted"] == pytest.approx(0.2)
    assert out["bubble_measured"] == pytest.approx(0.2)
    assert out["bubble_error_pp"] == pytest.approx(0.0, abs=1e-9)
    # (m + p - 1) slots of 6 blocks x 3 x 1 ms x 6 samples
    assert out["predicted_step_seconds"] == pytest.approx(10 * 0.108)
    assert out["predicted_over_measured"] == pytest.approx(1.08 / 1.3)


def test_bad_settings_are_one_line_errors():
    from hetrain.bench.pipeline import run

    with pytest.raises(HetrainError, match="multiple of --microbatches"):
        run(_args("--global-batch", "50", parsed=False))


def test_interleaved_plans_keep_each_ranks_share_in_chunks():
    args = _args("--schedule", "interleaved-1f1b", "--chunks", "3")
    made = plans(args)
    uneven = made["uneven"].pipeline
    assert uneven.schedule == "interleaved-1f1b" and uneven.chunks == 3
    assert [sum(b - a for a, b in uneven.stages[j::3]) for j in range(3)] == [6, 3, 3]
    assert [sum(b - a for a, b in made["even"].pipeline.stages[j::3]) for j in range(3)] == [4, 4, 4]
    with pytest.raises(HetrainError, match="at least 2 chunks"):
        from hetrain.bench.pipeline import run

        run(_args("--schedule", "interleaved-1f1b", "--chunks", "1", parsed=False))


def test_the_ideal_replays_torchs_schedule():
    """Equal stages: the replayed interleaved schedule idles exactly (p-1)/(v*m+p-1); the planner's
    partition in 3 chunks gains on 1F1B's fill and drain."""
    from hetrain.bench.pipeline_ideal import fill_drain_seconds, ideal_step_seconds
    from hetrain.planning.cost_model import pipeline_bubble

    # with fewer micro-batches than ranks a round waits for its first micro-batch to come back
    for p, m, v in [(3, 24, 3), (4, 8, 2), (3, 6, 2), (4, 5, 2), (2, 1, 4), (3, 1, 2), (4, 2, 2), (4, 3, 3)]:
        step = ideal_step_seconds("interleaved-1f1b", [1.0] * (p * v), m, v)
        assert 1 - m * v / step == pytest.approx(pipeline_bubble(p, m, v))
    assert fill_drain_seconds([1.0, 2.0, 2.0], 8) == 7 * 2.0 + 5.0
    args = _args("--schedule", "interleaved-1f1b", "--global-batch", "96", "--microbatches", "24")
    out = figures(args, {name: {"step_seconds": 1.0, "busy_seconds": [0.9] * 3, "pass_seconds": [1.0] * 3}
                         for name in ("uneven", "even", "data_parallel")})
    assert out["bubble_predicted"] == pytest.approx(2 / 74)
    assert out["predicted_step_seconds"] == pytest.approx((24 + 2 / 3) * 0.072)
    assert 1.33 < out["uneven_over_even_ideal"] < 1.34


def test_bench_pipeline_end_to_end_small():
    """The whole command on 3 CPU ranks, small: both partitions and data parallelism run and are timed."""
    import json
    import sys
    from pathlib import Path

    from tests.distributed import run_cli

    root = Path(__file__).resolve().parents[2]
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "pipeline", "--json", "--blocks", "6",
                 "--block-ms", "0.2", "--global-batch", "24", "--microbatches", "6", "--steps", "3", "--warmup", "1"],
                cwd=root, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["speeds"] == [1.0, 0.5, 0.5] and got["emulated"] is True
    # the planner gives the full-speed rank more blocks; both partitions cover the 6 blocks in order
    assert got["uneven_stages"] == [[0, 3], [3, 4], [4, 6]] and got["even_stages"] == [[0, 2], [2, 4], [4, 6]]
    assert set(got["step_seconds"]) == {"uneven", "even", "data_parallel"}
    assert all(s > 0 for s in got["step_seconds"].values())
    steps = got["step_seconds"]   # both are step-time ratios as benchmarks.md defines them
    assert got["uneven_over_even"] == pytest.approx(steps["even"] / steps["uneven"], rel=1e-3)
    assert got["dp_over_uneven"] == pytest.approx(steps["data_parallel"] / steps["uneven"], rel=1e-3)
    assert got["bubble_predicted"] == pytest.approx(2 / 8)   # (p - 1) / (m + p - 1), p = 3, m = 6

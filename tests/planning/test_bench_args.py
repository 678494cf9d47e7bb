"""Benchmark options that were checked only after ranks started (a traceback, or a pydantic error part way
through), or dropped in silence: each is refused before anything runs, in one error line naming it,
exit status 2, no traceback."""

import argparse
import sys
from pathlib import Path

import pytest

from hetrain.errors import HetrainError
from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]
SMALL_PREDICT = ["--rounds", "1", "--steps", "3", "--warmup", "1"]
SMALL_COMM = ["--steps", "12"]
SMALL_BALANCE = ["--speeds", "1,1", "--steps", "4", "--warmup", "1", "--global-batch-size", "16"]

CASES = [
    (["predict", "--micro-batches", "abc", *SMALL_PREDICT], "argument --micro-batches: 'abc' is not a whole number"),
    (["predict", "--micro-batches", "0", *SMALL_PREDICT], "argument --micro-batches: each must be at least 1"),
    (["predict", "--micro-batches", "32,,512", *SMALL_PREDICT], "argument --micro-batches: '' in '32,,512'"),
    (["predict", "--micro-batches", "32,-8", *SMALL_PREDICT], "argument --micro-batches: each must be at least 1"),
    (["comm", "--islands", "abc", *SMALL_COMM], "argument --islands: 'abc' is not islands of ranks"),
    (["comm", "--islands", "0,1;", *SMALL_COMM], "argument --islands: '0,1;' is not islands of ranks"),
    (["comm", "--islands", "0;5", *SMALL_COMM], "--islands '0;5' must name every rank 0..1 of --ranks 2 exactly once"),
    (["comm", "--islands", "0,1;1", *SMALL_COMM], "e.g. --islands '0;1'"),
    (["balance", "--outside-load", "1", "--metrics", *SMALL_BALANCE], "--metrics cannot be used with --outside-load"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_a_bad_option_is_refused_in_one_line_before_any_rank_starts(argv, message):
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", *argv], cwd=ROOT, timeout=240)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("hetrain bench"), r.stderr[-3000:]


def test_micro_batches_read_as_whole_numbers():
    from hetrain.bench.args import wholes

    assert wholes(1)("32,128, 512") == [32, 128, 512]
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        wholes(1)("8,0")


def test_islands_that_name_each_rank_once_pass():
    from hetrain.bench.comm import check_islands, parse_islands

    assert parse_islands("0,1;2,3") == [[0, 1], [2, 3]]
    check_islands("2,0;3,1", 4)
    check_islands("0;1", 2)
    check_islands(None, 2)
    for bad in ("0,1;2", "0,1;1,2,3", "0,1;2,3;4"):
        with pytest.raises(HetrainError, match="must name every rank 0..3"):
            check_islands(bad, 4)

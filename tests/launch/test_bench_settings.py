"""Every benchmark refuses a setting out of range before any rank starts: argparse's one error line,
naming the option, exit status 2, no traceback."""

import subprocess
import sys

import pytest

CASES = [
    ("bench", "balance", "--interval", "0"), ("demo", "--interval", "0"), ("demo", "--warmup", "-5"),
    ("bench", "balance", "--hidden", "0"), ("bench", "data", "--block", "0"), ("bench", "data", "--steps", "0"),
    ("bench", "data", "--device-ms", "-1"), ("bench", "pipeline", "--microbatches", "0"),
    ("bench", "pipeline", "--block-ms", "-1"), ("bench", "predict", "--width", "0"),
    ("bench", "memory", "--seq", "0"), ("bench", "recover", "--monitor-interval", "0"),
    ("bench", "comm", "--ranks", "1"), ("bench", "comm", "--topk-ratio", "2"), ("bench", "comm", "--lr", "nan"),
    ("bench", "plan", "--repeat", "0"),
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) for c in CASES])
def test_a_setting_out_of_range_is_one_error_line_naming_it(argv):
    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("hetrain ") and f"error: argument {argv[-2]}" in last and "must be" in last, last


@pytest.mark.parametrize("argv, text", [
    (("--preset", "nope"), "unknown preset 'nope'"),
    (("--global-batch-size", "1"), "--global-batch-size 1 is smaller than the 3 ranks"),
])
def test_bench_memory_refuses_its_cluster_and_batch_before_the_ranks(argv, text):
    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "bench", "memory", *argv], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"hetrain bench: error: {p.stderr.split('error: ', 1)[1].strip()}"]
    assert text in p.stderr, p.stderr

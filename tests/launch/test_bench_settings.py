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
